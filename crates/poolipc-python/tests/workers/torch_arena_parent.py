"""A parent for gpu_torch_test.py's arena tests, run in a fresh interpreter (the process's
parent sets the result memory once, and the suite's own parent is a pool parent):
``python torch_arena_parent.py CASE``. Installs the pool with results="arena" before torch,
spawns torch_worker.py (each result is ``x * 2 + 1``), runs CASE, and exits 0 after printing
``OK CASE``; a failed check raises (non-zero exit, the traceback on stderr).

dlpack     a float32 result is a torch tensor made by torch.from_dlpack over arena memory,
           holding the worker's values; deleting it gives the block back (arena_stats)
sizes      results of 1 byte and of 3 GiB arrive intact
per-job    results="pool" gives a torch.empty tensor of the shared pool, by pool pointer,
           next to an arena result from the same parent
cap        a result over arena_max_bytes fails its job with ArenaFullError; the next job works
slice      with set_arena_slice_bytes the torch worker's results are carved out of the job's
           arena slice (no round trip), intact, 4 KiB and 64 MiB; a slice too small asks
"""

import os
import sys
import time

import poolipc

CASE = sys.argv[1]
GIB = 1 << 30
MIB = 1 << 20
CAP = 512 * MIB if CASE == "cap" else None
poolipc.install_pool(0, results="arena", arena_bytes=256 * MIB, arena_max_bytes=CAP)

import torch  # noqa: E402  (after install_pool)

DEV = torch.device("cuda", 0)
HERE = os.path.dirname(os.path.abspath(__file__))
parent = poolipc.Parent(0)
w = parent.spawn([sys.executable, os.path.join(HERE, "torch_worker.py")], {"POOLIPC_TEST_MODE": "torch"})


def live():
    s = parent.arena_stats()
    return s["live_blocks"], s["results_out"]


def settled(want, timeout=10.0):
    end = time.monotonic() + timeout
    while True:
        torch.cuda.synchronize()
        got = live()
        if got == want or time.monotonic() > end:
            return got
        time.sleep(0.01)


def random_bytes(n):
    return torch.empty(n, dtype=torch.uint8, device=DEV).random_()


base = live()
if CASE == "dlpack":
    x = torch.arange(1 << 20, device=DEV, dtype=torch.float32).remainder_(1000).add_(1)
    (y,) = parent.run(w, [x])
    assert isinstance(y, torch.Tensor) and y.device == DEV and y.dtype == x.dtype
    assert parent.last_result_rungs == ["arena"], parent.last_result_rungs
    torch.testing.assert_close(y, x * 2 + 1)
    assert live() == (base[0] + 1, base[1] + 1), live()
    del y  # torch frees the storage: the DLPack deleter gives the block back
    assert settled(base) == base, live()
    # the memory is reused: the arena does not grow for the next result
    capacity = parent.arena_stats()["capacity"]
    (y,) = parent.run(w, [x])
    assert parent.arena_stats()["capacity"] == capacity
    torch.testing.assert_close(y, x * 2 + 1)
    del y
    assert settled(base) == base, live()
elif CASE == "sizes":
    for n in (1, 3 * GIB):
        x = random_bytes(n)
        (y,) = parent.run(w, [x])
        assert parent.last_result_rungs == ["arena"], parent.last_result_rungs
        assert y.shape == (n,) and torch.equal(y, x * 2 + 1), n
        del x, y
        assert settled(base) == base, live()
elif CASE == "per-job":
    x = torch.arange(4099, device=DEV, dtype=torch.float32)
    (a,) = parent.run(w, [x])
    assert parent.last_result_rungs == ["arena"]
    (p,) = parent.run(w, [x], results="pool")
    assert parent.last_result_rungs == ["pool pointer"]
    torch.testing.assert_close(a, x * 2 + 1)
    torch.testing.assert_close(p, x * 2 + 1)
    assert parent.stats()["arena_results"] >= 1
    del a, p
    assert settled(base) == base, live()
elif CASE == "cap":
    x = random_bytes(GIB)
    try:
        parent.run(w, [x])
    except poolipc.ArenaFullError as e:
        assert isinstance(e, MemoryError) and str(CAP) in str(e) and str(GIB) in str(e), str(e)
    else:
        raise AssertionError("a result over the cap was not refused")
    x = random_bytes(MIB)
    (y,) = parent.run(w, [x])
    assert torch.equal(y, x * 2 + 1)
    del y
    assert settled(base) == base, live()
elif CASE == "slice":
    parent.set_arena_slice_bytes(128 * MIB)
    s0 = parent.stats()
    xs = [random_bytes(4096), random_bytes(64 * MIB)]
    ys = parent.run(w, xs)
    s1 = parent.stats()
    assert s1["arena_results_carved"] == s0["arena_results_carved"] + 2, s1
    assert parent.last_result_rungs == ["arena", "arena"], parent.last_result_rungs
    for x, y in zip(xs, ys):
        assert torch.equal(y, x * 2 + 1)
    parent.set_arena_slice_bytes(4096)
    (z,) = parent.run(w, [xs[1]])  # 64 MiB does not fit a 4 KiB slice: asked for
    s2 = parent.stats()
    assert s2["arena_results_carved"] == s1["arena_results_carved"], s2
    assert s2["arena_slices_lent"] == s1["arena_slices_lent"] + 1, s2
    assert torch.equal(z, xs[1] * 2 + 1)
    parent.set_arena_slice_bytes(0)
    del ys, z, y  # y: the loop's last result
    assert settled(base) == base, live()
else:
    raise SystemExit(f"unknown case {CASE!r}")
parent.stop(w)
print("OK", CASE)
