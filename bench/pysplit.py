"""What Python adds to a round trip, and where: the same handoff (4 KiB and 64 MiB, lent
again) through these pairs in one run, on the GPU (`POOLIPC_DRIVER=sim`: on the simulated
driver):

  rust -> rust      `poolipc bench --workers 1` (the facade's parent and echo worker), its
                    callers on the legacy stream as this process's parent lends (like for
                    like), and on a stream of their own (the bench's default)
  python -> rust    this process's `poolipc.Parent` and the Rust echo worker
  python -> python  this process's `poolipc.Parent` and a Python `poolipc.Worker`

No torch: the parent lends a `DeviceBuffer` of the pool, the Python worker takes the job and
finishes it (no work of its own, so what is left above rust -> rust is the binding's). With
``--probe DIR`` the python -> python round trips are run again with `POOLIPC_PROBE` and
`bench/probe_report.py` prints the median of each step: the binding's marks (`py.*`) split
the time into the binding's, the facade's (`c.*`, `io.*`, `w.*`) and the worker's own code
(`py.job` -> `py.end`, here empty).

    POOLIPC_DRIVER=sim python3 bench/pysplit.py [--jobs 2000] [--probe /tmp/split] [--json]
    python3 bench/pysplit.py --workers 8 [--jobs 2000]

With ``--workers N``: jobs per second with 1, 2, 4 .. N Python threads at once, each with its
own torch-free Python worker and 4 KiB buffer (the legacy stream, as above), beside
``poolipc bench --workers N`` with its callers on the legacy stream, in the same run: how the
binding scales (the GIL) without torch's own cost in the way (``bench/pybench.py --workers``
has it); the same Python threads with Rust echo workers, the parent's side alone; and one
Python thread driving every Rust echo worker with ``submit`` and ``wait`` (no GIL hand-over
between threads).

On the GPU, run it under MPS too (`poolipc mps -- python3 bench/pysplit.py`): the
target is python -> python within 15 us of rust -> rust, plainly and under MPS.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent

# Like `__demo-worker` in `noop` mode: take each job, finish it.
PY_WORKER = """
import poolipc
w = poolipc.Worker()
for job in w:
    with job:
        pass
poolipc._native.probe_dump()
"""


def binary() -> str:
    """The `poolipc` binary: POOLIPC_BIN, else the newest build of this checkout."""
    env = os.environ.get("POOLIPC_BIN")
    if env:
        return env
    built = [REPO / "target" / p / "poolipc" for p in ("release", "debug")]
    built += [REPO / "target" / "gpu-bundle" / "poolipc"]
    built = [p for p in built if p.exists()]
    if not built:
        sys.exit("pysplit: no poolipc binary (cargo build -p poolipc-cli, or set POOLIPC_BIN)")
    return str(max(built, key=lambda p: p.stat().st_mtime))


SIZES = (4096, 64 << 20)


def bench_rows(bin_: str, workers: int, jobs: int, stream: str) -> list[dict] | None:
    """The rows of `poolipc bench --workers N --worker-mode noop --caller-stream STREAM`
    (None if it failed, said on stderr)."""
    out_json = pathlib.Path(f"/tmp/pysplit-{os.getpid()}.json")
    # `--prime canary`: the battery the Python parent runs on each worker by default (without
    # it, plainly, the Rust parent paid the GPU's turn-taking and the Python one did not:
    # 286 against 23-25 us a 4 KiB job, H100, 2026-12-05; docs/facts.md).
    args = [bin_, "bench", "--workers", str(workers), "--worker-mode", "noop", "--iterations",
            str(jobs), "--caller-stream", stream, "--prime", "canary", "--json-out", str(out_json)]
    if os.environ.get("POOLIPC_DRIVER") == "sim":
        args.append("--sim")
    env = {k: v for k, v in os.environ.items() if k != "POOLIPC_PROBE"}
    out = subprocess.run(args, capture_output=True, text=True, env={**env, "RUST_LOG": "warn"})
    if out.returncode != 0:
        print(f"pysplit: {' '.join(args)} failed:\n{out.stdout[-1000:]}{out.stderr[-2000:]}", file=sys.stderr)
        return None
    data = json.loads(out_json.read_text())
    out_json.unlink()
    return data["rows"]


def rust_pair(bin_: str, jobs: int, stream: str) -> dict[int, float] | None:
    """rust -> rust: microseconds per job of `bench_rows` with one worker, by size (one
    worker, so a job's time is its round trip)."""
    rows = bench_rows(bin_, 1, jobs, stream)
    if rows is None:
        return None
    got = {row["bytes"]: 1e6 / row["jobs_per_s"] for row in rows if row["workers"] == 1}
    if any(size not in got for size in SIZES):
        print(f"pysplit: no row with one worker for each of {SIZES} in {rows}", file=sys.stderr)
        return None
    return got


def python_pair(parent, worker: int, buf, jobs: int, mark: bool) -> float:
    """Median microseconds of `parent.run(worker, [buf])`, after a warm-up."""
    import poolipc

    for _ in range(max(jobs // 10, 20)):
        parent.run(worker, [buf])
    times = []
    for _ in range(jobs):
        if mark:
            poolipc._native.probe_mark("rt.begin")
        t0 = time.perf_counter_ns()
        parent.run(worker, [buf])
        times.append((time.perf_counter_ns() - t0) / 1000)
        if mark:
            poolipc._native.probe_mark("rt.synced")
    return statistics.median(times)


def counts(n: int) -> list[int]:
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]


def rust_rates(bin_: str, workers: int, jobs: int) -> dict[int, float]:
    """`bench_rows` on the legacy stream: 4 KiB jobs/s by worker count (empty if it
    failed)."""
    rows = bench_rows(bin_, workers, jobs, "legacy") or []
    return {row["workers"]: row["jobs_per_s"] for row in rows if row["bytes"] == 4096}


def python_rates(parent, workers: list[int], jobs: int) -> dict[int, float]:
    """4 KiB jobs/s with 1, 2, 4 .. len(workers) threads at once, each on its own worker."""
    import threading

    rates = {}
    for n in counts(len(workers)):
        start, end = threading.Barrier(n + 1), threading.Barrier(n + 1)
        errors: list[BaseException] = []

        def serve(w: int) -> None:
            try:
                buf = parent.alloc(4096, dtype="uint8", shape=[4096])
                for _ in range(max(jobs // 10, 1)):
                    parent.run(w, [buf])
                start.wait()
                for _ in range(jobs):
                    parent.run(w, [buf])
                end.wait()
            except BaseException as e:  # noqa: BLE001  (reported after the barriers)
                errors.append(e)
                start.abort()
                end.abort()

        threads = [threading.Thread(target=serve, args=(w,)) for w in workers[:n]]
        for t in threads:
            t.start()
        try:
            start.wait()
            t0 = time.perf_counter()
            end.wait()
            rates[n] = n * jobs / (time.perf_counter() - t0)
        except threading.BrokenBarrierError:
            pass
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    return rates


def fanout_rates(parent, workers: list[int], jobs: int) -> dict[int, float]:
    """4 KiB jobs/s with 1, 2, 4 .. len(workers) workers driven by this one thread: a job
    submitted to each, then, as each ends (oldest first), the next to the same worker. No
    second Python thread, so no wait for the GIL between them."""
    from collections import deque

    rates = {}
    for n in counts(len(workers)):
        ws = workers[:n]
        bufs = [parent.alloc(4096, dtype="uint8", shape=[4096]) for _ in ws]
        for _ in range(max(jobs // 10, 1)):
            for w, b in zip(ws, bufs):
                parent.run(w, [b])
        total = n * jobs
        t0 = time.perf_counter()
        pending = deque((i, parent.submit(w, [b])) for i, (w, b) in enumerate(zip(ws, bufs)))
        submitted, done = n, 0
        while pending:
            i, h = pending.popleft()
            h.wait()
            done += 1
            if submitted < total:
                pending.append((i, parent.submit(ws[i], [bufs[i]])))
                submitted += 1
        rates[n] = done / (time.perf_counter() - t0)
        del bufs
    return rates


def scaling(workers: int, jobs: int, as_json: bool) -> int:
    import poolipc

    bin_ = binary()
    rust = rust_rates(bin_, workers, jobs)
    parent = poolipc.Parent(0)
    ws = [parent.spawn([sys.executable, "-c", PY_WORKER]) for _ in range(workers)]
    try:
        py = python_rates(parent, ws, jobs)
    finally:
        for w in ws:
            parent.stop(w)
    # The same Python threads with Rust echo workers: the parent's side alone (its GIL).
    ws = [parent.spawn([bin_, "__demo-worker"], {"POOLIPC_WORKER_MODE": "noop"}) for _ in range(workers)]
    try:
        py_rust = python_rates(parent, ws, jobs)
        one_thread = fanout_rates(parent, ws, jobs)
    finally:
        for w in ws:
            parent.stop(w)
    if as_json:
        print(json.dumps({"driver": parent.driver, "python": py, "python_rust": py_rust,
                          "one_thread": one_thread, "rust": rust}))
        return 0

    def cell(rates: dict, n: int, width: int) -> str:
        v = rates.get(n)
        x = f"{v / rates[1]:6.2f}x" if v and rates.get(1) else ""
        return f"{'' if v is None else f'{v:{width}.0f}'} {x:>7}"

    print(f"4 KiB lent again, N threads at once each with its own worker, {jobs} jobs each, {parent.driver}:")
    print(f"  {'workers':>8} {'python jobs/s':>14} {'x one':>7} {'py->rust jobs/s':>16} {'x one':>7} "
          f"{'1-thread jobs/s':>16} {'x one':>7} {'rust jobs/s':>12} {'x one':>7}")
    for n in counts(workers):
        print(f"  {n:>8} {cell(py, n, 14)} {cell(py_rust, n, 16)} {cell(one_thread, n, 16)} "
              f"{cell(rust or {}, n, 12)}")
    print("  python: Python threads and Python workers; py->rust: the same threads, Rust echo workers;")
    print("  1-thread: the main thread alone submitting to every Rust echo worker (submit, then wait the oldest)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2000, help="round trips per pair (default 2000)")
    ap.add_argument("--probe", type=pathlib.Path, help="also run python -> python with POOLIPC_PROBE=DIR and print the split")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--workers", type=int, help="jobs/s with 1, 2, 4 .. N Python threads at once (no split)")
    a = ap.parse_args()
    if a.workers is not None:
        if not 1 <= a.workers <= 64:
            ap.error(f"--workers {a.workers}: give 1 to 64")
        return scaling(a.workers, a.jobs, a.json)
    if a.probe is not None:
        # Set before poolipc is imported: the binding reads it once.
        shutil.rmtree(a.probe, ignore_errors=True)
        a.probe.mkdir(parents=True)
        os.environ["POOLIPC_PROBE"] = str(a.probe)
    bin_ = binary()
    rust = rust_pair(bin_, a.jobs, "legacy")
    rust_own = rust_pair(bin_, a.jobs, "own")

    import poolipc

    parent = poolipc.Parent(0)
    rows: dict = {"driver": parent.driver, "sizes": {}}
    w_rust = parent.spawn([bin_, "__demo-worker"], {"POOLIPC_WORKER_MODE": "noop"})
    w_py = parent.spawn([sys.executable, "-c", PY_WORKER])
    for size in SIZES:
        buf = parent.alloc(size, dtype="uint8", shape=[size])
        # The probe's split is of the 4 KiB python -> python round trips (the first marked).
        mark = a.probe is not None and size == SIZES[0]
        rows["sizes"][size] = {
            "rust -> rust": None if rust is None else rust[size],
            "rust -> rust, own stream": None if rust_own is None else rust_own[size],
            "python -> rust": python_pair(parent, w_rust, buf, a.jobs, False),
            "python -> python": python_pair(parent, w_py, buf, a.jobs, mark),
        }
        del buf
    parent.stop(w_rust)
    parent.stop(w_py)
    if a.json:
        print(json.dumps(rows))
    else:
        print(f"lent again, {a.jobs} round trips each, {rows['driver']} (rust -> rust: its callers on the legacy stream, as here):")
        print(f"  {'pair':26} {'size':>7} {'median us':>10} {'- rust':>8}")
        for size, got in rows["sizes"].items():
            base = got["rust -> rust"]
            for k, v in got.items():
                extra = "" if v is None or base is None or k.startswith("rust") else f"{v - base:+8.1f}"
                label = "4 KiB" if size == 4096 else f"{size >> 20} MiB"
                print(f"  {k:26} {label:>7} {'' if v is None else f'{v:10.1f}'} {extra}")
    if a.probe is not None:
        poolipc._native.probe_dump()
        # The worker dumps when its loop ends (stop's Bye): give the file a moment.
        time.sleep(0.5)
        subprocess.run([sys.executable, str(HERE / "probe_report.py"), str(a.probe),
                        "--skip", "1", "--count", str(a.jobs), "--title", "python -> python, 4 KiB lent again"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
