"""VRAM goes back: free device memory before and after big tensors are freed and
``torch.cuda.empty_cache()`` is called with poolipc's pool installed: never lent, lent by
pool pointer, lent by arena copy; what the arena gave back; another process then allocating
what was freed; torch's figures against the pool's; what ``empty_cache`` costs with nothing
to trim.

    python3 bench/vram.py [--gib 24]

Exits 1 when a figure misses its bound. The pool-pointer case counts too: the driver keeps an
exported allocation's memory until its pool is destroyed (docs/facts.md, "Other driver behaviour designed for"),
so ``empty_cache`` rotates the pool (a new one becomes current, the worker is given it) and
destroys the old one in the worker and the parent; the worker must keep serving afterwards.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import poolipc

poolipc.install_pool(results="arena")
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 1 << 30
MIB = 1 << 20


def free_gib():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / GIB


def figures():
    s = poolipc.memory_stats()
    return (
        f"torch reserved {torch.cuda.memory_reserved() / GIB:.3f} / pool {s['reserved_current'] / GIB:.3f} GiB, "
        f"allocated {torch.cuda.memory_allocated() / GIB:.3f} / pool used {s['used_current'] / GIB:.3f} GiB"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=24)
    a = ap.parse_args()
    n = a.gib * GIB
    ok = True
    # torch loads its kernels at their first use (about 160 MiB of device memory that no
    # empty_cache gives back): use the ones measured here once before the start is read.
    w0 = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    w0.fill_(1)
    w0.add_(1)
    del w0
    torch.cuda.empty_cache()
    start = free_gib()
    print(f"free at start: {start:.3f} GiB")
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    print(f"{a.gib} GiB allocated: {figures()}")
    del x
    print(f"{a.gib} GiB freed:       {free_gib():.3f} GiB free (the pool keeps it); {figures()}")
    t0 = time.perf_counter()
    torch.cuda.empty_cache()
    ms = (time.perf_counter() - t0) * 1e3
    back = free_gib()
    print(f"torch.cuda.empty_cache(): {back:.3f} GiB free ({ms:.1f} ms); {(start - back) * 1024:.0f} MiB short of the start")
    ok = ok and start - back < 64 / 1024

    p = poolipc.Parent(0)
    w = p.spawn_python(os.path.join(HERE, "inplace_worker.py"))
    base = free_gib()
    print(f"a torch worker started: {base:.3f} GiB free (its context: {start - base:.3f} GiB)")

    # By arena copy: over the import limit (128 chunks of 32 MiB), never exported.
    x = torch.full((n,), 3, dtype=torch.uint8, device="cuda")
    p.run(w, [x])
    rung = p.last_input_rungs
    assert int(x[0]) == 4 and int(x[-1]) == 4, "the worker's in-place write did not come back"
    del x
    s = p.arena_stats()
    print(f"{a.gib} GiB lent ({rung}), written in place, freed: arena {s['capacity'] / GIB:.3f} GiB; {free_gib():.3f} GiB free")
    t0 = time.perf_counter()
    released = poolipc.empty_cache()
    ms = (time.perf_counter() - t0) * 1e3
    back = free_gib()
    s = p.arena_stats()
    print(f"empty_cache: {released / GIB:.3f} GiB given back ({ms:.1f} ms), arena now {s['capacity'] / GIB:.3f} GiB "
          f"(released {s['released_bytes'] / GIB:.3f}); {back:.3f} GiB free, {(base - back) * 1024:.0f} MiB short of before the lend")
    ok = ok and rung == ["arena copy"] and base - back < 64 / 1024

    # By pool pointer: exported, so the driver keeps it after the free until the pool is
    # destroyed: empty_cache rotates the pool and destroys the old one (worker first).
    base = free_gib()
    x = torch.full((2 * GIB,), 3, dtype=torch.uint8, device="cuda")
    p.run(w, [x])
    rung = p.last_input_rungs
    assert int(x[0]) == 4 and int(x[-1]) == 4, "the worker's in-place write did not come back"
    del x
    held = free_gib()
    print(f"2 GiB lent ({rung}), written in place, freed: {held:.3f} GiB free, {(base - held) * 1024:.0f} MiB held "
          f"(exported: the driver keeps it); {figures()}")
    t0 = time.perf_counter()
    torch.cuda.empty_cache()
    ms = (time.perf_counter() - t0) * 1e3
    back = free_gib()
    print(f"torch.cuda.empty_cache() (pool rotated, old one destroyed): {back:.3f} GiB free ({ms:.1f} ms); "
          f"{(base - back) * 1024:.0f} MiB short of before the lend; {figures()}")
    ok = ok and rung == ["pool pointer"] and base - back < 64 / 1024
    # The worker keeps serving from the new pool: a new tensor, by pool pointer again.
    y = torch.full((64 * MIB,), 5, dtype=torch.uint8, device="cuda")
    p.run(w, [y])
    rung = p.last_input_rungs
    served = int(y[0]) == 6 and int(y[-1]) == 6
    print(f"after the rotation: 64 MiB lent ({rung}), written in place: {'ok' if served else 'WRONG BYTES'}")
    ok = ok and served and rung == ["pool pointer"]
    del y
    p.stop(w)
    torch.cuda.empty_cache()
    back3 = free_gib()
    print(f"the worker stopped, empty_cache: {back3:.3f} GiB free; {(start - back3) * 1024:.0f} MiB short of the start")
    print(f"figures now: {figures()}")

    # Another process takes what was given back.
    want = int((free_gib() - 4) * GIB)
    r = subprocess.run(
        [sys.executable, "-c", f"import torch; t = torch.empty({want}, dtype=torch.uint8, device='cuda'); print('ok')"],
        capture_output=True, text=True, timeout=120,
    )
    print(f"another process allocates {want / GIB:.1f} GiB: {'ok' if r.returncode == 0 else 'REFUSED: ' + r.stderr[-200:]}")
    ok = ok and r.returncode == 0

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
    print("vram.py:", "ok" if ok else "MISSED A BOUND")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
