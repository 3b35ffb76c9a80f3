"""A CUDA tensor's round trip through torch.multiprocessing: poolipc under
``backend:cudaMallocAsync`` beside torch's own legacy CUDA IPC under its native allocator, in
the same run, on the same GPU.

The parent puts a tensor on an ``mp.Queue``; a spawned worker maps it, writes one element in
place, synchronizes and replies; the parent checks the write. Sizes: 4 KiB (the same tensor
again: torch's handle cache, poolipc's re-import) and 1 GiB (a new tensor each time, then the
same one again).

    python3 bench/torchmp_share.py [--reps N] [--pairs N]

Runs the backends in N pairs (3 by default), each pair's order the other way round from the
last (torch, poolipc, poolipc, torch, torch, poolipc, ...), and prints one JSON line per run and
(backend, size), then a table over all runs of each and, per size, poolipc's time as a ratio
of torch's within each pair (its median and range, and in how many pairs it was at or under
torch's): the machine's drift over the run (clocks, neighbours) weighs on both sides of a
pair alike. Exits non-zero if a round trip read wrong bytes or a backend failed. Each row also splits the round trip (medians, from
CLOCK_MONOTONIC stamps both processes take): ``to_worker_ms`` from the put until the worker
holds the tensor (pickling, the pipe, the rebuild), ``in_worker_ms`` the write and the
synchronize, ``back_ms`` from the worker's reply until the parent has it (with the release of
the worker's previous share in flight).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

SIZES = [("4KiB", 1024, "same"), ("1GiB", 1 << 28, "new"), ("1GiB", 1 << 28, "same")]


def now() -> int:
    """Nanoseconds on the clock both processes share."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def worker(q_in, q_out):
    import torch

    torch.cuda.init()
    while True:
        t = q_in.get()
        got = now()
        if t is None:
            return
        t[0] = 42
        torch.cuda.synchronize()
        q_out.put((got, now()))
        del t


def start(backend: str, target, *args):
    """This process set up as `backend` ("poolipc": its pool under cudaMallocAsync and
    ``torch_sharing`` enabled; "torch": torch's native allocator and its own IPC) and a
    spawned child running ``target(*args, q_in, q_out)``. Returns torch, the two queues and
    the child. The probes beside this file set their backends up through it too, so that
    every comparison starts from the same setup."""
    if backend == "poolipc":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
        import poolipc

        poolipc.install_pool(0)
    else:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    import torch
    import torch.multiprocessing as mp

    if backend == "poolipc":
        poolipc.torch_sharing.enable()
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q_in, q_out), daemon=True)
    p.start()
    return torch, q_in, q_out, p


def run(backend: str, reps: int) -> None:
    torch, q_in, q_out, p = start(backend, worker)
    warm = torch.zeros(4, device="cuda")
    q_in.put(warm)
    q_out.get(timeout=120)
    del warm
    for label, numel, kind in SIZES:
        n = reps if kind == "same" else max(5, reps // 20)
        same = torch.zeros(numel, device="cuda")
        times = []
        phases = []
        for _ in range(n):
            t = same if kind == "same" else torch.zeros(numel, device="cuda")
            t[0] = 0
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            put = now()
            q_in.put(t)
            got, synced = q_out.get(timeout=120)
            back = now()
            times.append(time.perf_counter() - t0)
            phases.append((got - put, synced - got, back - synced))
            if float(t[0].item()) != 42.0:
                raise SystemExit(f"{backend} {label}: the worker's write is missing")
            del t
        rec = {
            "event": "torchmp_share",
            "backend": backend,
            "allocator": "cudaMallocAsync" if backend == "poolipc" else "native",
            "size": label,
            "tensor": kind,
            "reps": n,
            "median_ms": statistics.median(times[1:]) * 1e3,
            "samples_ms": [round(x * 1e3, 4) for x in times[1:]],
            "first_ms": times[0] * 1e3,
            "to_worker_ms": statistics.median(x[0] for x in phases[1:]) / 1e6,
            "in_worker_ms": statistics.median(x[1] for x in phases[1:]) / 1e6,
            "back_ms": statistics.median(x[2] for x in phases[1:]) / 1e6,
            "gpu": torch.cuda.get_device_name(0),
        }
        print(json.dumps(rec), flush=True)
    q_in.put(None)
    p.join(60)


def main() -> int:
    reps = 200
    if "--reps" in sys.argv:
        reps = int(sys.argv[sys.argv.index("--reps") + 1])
    pairs = 3
    if "--pairs" in sys.argv:
        pairs = max(1, int(sys.argv[sys.argv.index("--pairs") + 1]))
    if len(sys.argv) > 2 and sys.argv[1] == "--backend":
        run(sys.argv[2], reps)
        return 0
    rows = []
    failed = False
    # Pairs in alternating order (torch, poolipc, poolipc, torch, ...): a drift of the machine
    # over the run (clocks, neighbours) weighs on both alike.
    order = []
    for i in range(pairs):
        order += [(i, "torch"), (i, "poolipc")] if i % 2 == 0 else [(i, "poolipc"), (i, "torch")]
    for pair, backend in order:
        r = subprocess.run(
            [sys.executable, __file__, "--backend", backend, "--reps", str(reps)],
            capture_output=True, text=True, timeout=900,
        )
        sys.stderr.write(r.stderr[-3000:] if r.returncode else "")
        for line in r.stdout.splitlines():
            if line.startswith("{"):
                rec = json.loads(line)
                rec["pair"] = pair
                rows.append(rec)
                print(json.dumps({k: v for k, v in rec.items() if k != "samples_ms"}), flush=True)
        if r.returncode:
            print(f"FAIL {backend}: exit {r.returncode}", flush=True)
            failed = True
    # Both runs of a backend pooled: the median of all their round trips, the mean of their
    # phases' medians.
    by = {}
    for x in rows:
        key = (x["backend"], x["size"], x["tensor"])
        if key not in by:
            by[key] = dict(x, runs=1)
            continue
        b = by[key]
        b["samples_ms"] = b["samples_ms"] + x["samples_ms"]
        b["median_ms"] = statistics.median(b["samples_ms"])
        for k in ("to_worker_ms", "in_worker_ms", "back_ms"):
            b[k] = (b[k] * b["runs"] + x[k]) / (b["runs"] + 1)
        b["runs"] += 1
    print(f"\n{'size':6} {'tensor':6} {'torch native IPC (ms)':>22} {'poolipc async (ms)':>20}  verdict")
    for label, _, kind in SIZES:
        a, b = by.get(("torch", label, kind)), by.get(("poolipc", label, kind))
        if a and b:
            verdict = "<= torch" if b["median_ms"] <= a["median_ms"] else "slower than torch"
            print(f"{label:6} {kind:6} {a['median_ms']:22.3f} {b['median_ms']:20.3f}  {verdict}")
    print(f"\npoolipc / torch within each of {pairs} pair(s) (medians' ratio): median [range], pairs at or under torch")
    for label, _, kind in SIZES:
        ratios = []
        for i in range(pairs):
            a = [x for x in rows if (x["backend"], x["size"], x["tensor"], x["pair"]) == ("torch", label, kind, i)]
            b = [x for x in rows if (x["backend"], x["size"], x["tensor"], x["pair"]) == ("poolipc", label, kind, i)]
            if a and b:
                ratios.append(b[0]["median_ms"] / a[0]["median_ms"])
        if ratios:
            ratios.sort()
            under = sum(r <= 1.0 for r in ratios)
            print(f"{label:6} {kind:6} {statistics.median(ratios):6.3f}x [{ratios[0]:.3f}-{ratios[-1]:.3f}]  {under} of {len(ratios)}")
    print("\nwhere the round trip goes (medians, ms): to the worker / in the worker / back")
    for (backend, label, kind), x in sorted(by.items()):
        if "to_worker_ms" in x:
            print(f"{backend:8} {label:6} {kind:6} {x['to_worker_ms']:8.3f} {x['in_worker_ms']:8.3f} "
                  f"{x['back_ms']:8.3f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
