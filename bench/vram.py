"""VRAM goes back (issue 23, first part): free device memory before and after a big tensor is
freed and ``torch.cuda.empty_cache()`` is called with poolipc's pool installed, before and
after a lend by pool pointer; another process then allocating what was freed; what
``empty_cache`` costs with nothing to trim.

    python3 bench/vram.py [--gib 24]
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import poolipc

poolipc.install_pool()
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 1 << 30


def free_gib():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / GIB


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=24)
    a = ap.parse_args()
    n = a.gib * GIB
    start = free_gib()
    print(f"free at start: {start:.2f} GiB")
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    del x
    print(f"{a.gib} GiB allocated and freed:       {free_gib():.2f} GiB free (the pool keeps it)")
    t0 = time.perf_counter()
    torch.cuda.empty_cache()
    ms = (time.perf_counter() - t0) * 1e3
    back = free_gib()
    print(f"torch.cuda.empty_cache():             {back:.2f} GiB free ({ms:.1f} ms); {start - back:.3f} GiB short of the start")
    ok = start - back < 64 / 1024

    # Lent by pool pointer to a torch worker (exported, imported, released), then freed.
    p = poolipc.Parent(0)
    w = p.spawn_python(os.path.join(HERE, "inplace_worker.py"))
    x = torch.full((4 * GIB,), 3, dtype=torch.uint8, device="cuda")
    p.submit(w, [x]).wait()
    del x
    torch.cuda.empty_cache()
    back2 = free_gib()
    print(f"a 4 GiB tensor lent by pool pointer, freed, empty_cache: {back2:.2f} GiB free; {start - back2:.3f} GiB short (the worker still runs)")
    ok = ok and start - back2 < 0.25  # the worker's own context, allocations of the canary
    p.stop(w)
    torch.cuda.empty_cache()
    back3 = free_gib()
    print(f"the worker stopped, empty_cache: {back3:.2f} GiB free; {start - back3:.3f} GiB short")

    # Another process takes what was given back.
    want = int((free_gib() - 4) * GIB)
    r = subprocess.run(
        [sys.executable, "-c", f"import torch; t = torch.empty({want}, dtype=torch.uint8, device='cuda'); print('ok')"],
        capture_output=True, text=True, timeout=120,
    )
    print(f"another process allocates {want / GIB:.1f} GiB: {'ok' if r.returncode == 0 else 'REFUSED: ' + r.stderr[-200:]}")
    ok = ok and r.returncode == 0

    # empty_cache with nothing to trim.
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        poolipc.empty_cache()
        times.append((time.perf_counter() - t0) * 1e6)
    print(f"poolipc.empty_cache() with nothing to trim: median {statistics.median(times):.1f} us")
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        torch.cuda.empty_cache()
        times.append((time.perf_counter() - t0) * 1e6)
    print(f"torch.cuda.empty_cache() (torch's and the pool's) with nothing to trim: median {statistics.median(times):.1f} us")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
