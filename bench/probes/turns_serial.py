"""Without MPS, what makes several workers slower than one: jobs on two contexts at once, or
any change of context between jobs?

Measured on an H100 (driver 580, 2026-12-05, no MPS): one Rust worker at 32-38k jobs/s and two or more together
at about 7200 jobs/s, each worker with a caller thread of its own (their jobs overlap on the
GPU). Here one thread drives every worker, so that how the jobs interleave is chosen:

  one            a single worker, submit and wait, back to back
  alternate      N workers in turn, one job in flight at a time (A, B, A, B, ...)
  bursts of K    N workers in turn, K jobs each before the next (one job in flight)
  overlapped     one job in flight on every worker at once (submit to each, wait the oldest)

If `alternate` were as fast as `one`, a parent that lets one worker at a time have a job in
flight would give N workers one worker's rate; it is not (H100, driver 580: 4 workers
alternate 2545-2817 jobs/s, bursts of 64 0.73-0.78x of one worker, overlapped 7230, one
46000; 2026-12-05): every change of context costs about 330 us, so the
parent holds a worker's turn for a time instead (Tuning::gpu_turn). Set
POOLIPC_GPU_TURN_US=0 to measure these patterns without the parent's turns.

    python3 bench/probes/turns_serial.py [--workers 2] [--mode touch|noop] [--window-ms 500]

POOLIPC_BIN names the `poolipc` binary whose `__demo-worker` serves the jobs (`touch`: a
write of the input's first bytes on the job's stream, `poolipc bench`'s workers; `noop`: no
work of the worker's own). POOLIPC_DRIVER=sim runs it on the simulated driver (no meaning
there beyond the script working).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque


def window_rate(step, window: float) -> float:
    """Jobs/s of `step()` (which runs one job and returns how many it ran) for `window` s."""
    done, t0 = 0, time.perf_counter()
    while True:
        done += step()
        dt = time.perf_counter() - t0
        if dt >= window:
            return done / dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--mode", default="touch", choices=["touch", "noop"])
    ap.add_argument("--window-ms", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import poolipc

    bin_ = os.environ.get("POOLIPC_BIN")
    if not bin_:
        sys.exit("turns_serial: set POOLIPC_BIN to the poolipc binary")
    window = args.window_ms / 1000
    parent = poolipc.Parent(0)
    env = {"POOLIPC_WORKER_MODE": args.mode}
    ws = [parent.spawn([bin_, "__demo-worker"], env) for _ in range(args.workers)]
    bufs = [parent.alloc(4096, dtype="uint8", shape=[4096]) for _ in ws]
    for w, b in zip(ws, bufs):
        for _ in range(50):
            parent.run(w, [b])

    def one() -> int:
        parent.run(ws[0], [bufs[0]])
        return 1

    def serial(k: int):
        state = {"i": 0}

        def step() -> int:
            i = state["i"]
            state["i"] = (i + 1) % len(ws)
            for _ in range(k):
                parent.run(ws[i], [bufs[i]])
            return k

        return step

    def overlapped():
        pending = deque((i, parent.submit(w, [b])) for i, (w, b) in enumerate(zip(ws, bufs)))

        def step() -> int:
            i, h = pending.popleft()
            h.wait()
            pending.append((i, parent.submit(ws[i], [bufs[i]])))
            return 1

        return step, pending

    print(f"driver: {parent.driver}; {len(ws)} Rust workers ({args.mode}), 4 KiB lent again, "
          f"{args.window_ms} ms windows, one Python thread")
    print(f"  {'pattern':<18} {'jobs/s':>9} {'x one':>7}")
    for r in range(args.rounds):
        base = window_rate(one, window)
        rows = [("one", base)]
        rows.append(("alternate", window_rate(serial(1), window)))
        for k in (4, 16, 64):
            rows.append((f"bursts of {k}", window_rate(serial(k), window)))
        step, pending = overlapped()
        rows.append(("overlapped", window_rate(step, window)))
        for _, h in pending:
            h.wait()
        print(f"  round {r + 1}")
        for name, rate in rows:
            print(f"  {name:<18} {rate:>9.0f} {rate / base:>6.2f}x")
    for w in ws:
        parent.stop(w)
    return 0


if __name__ == "__main__":
    sys.exit(main())
