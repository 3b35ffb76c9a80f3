"""Where a small CUDA tensor's trip through torch.multiprocessing spends its time: each step of
the sender's and the receiver's side timed in place, poolipc under ``backend:cudaMallocAsync``
beside torch's own IPC under its native allocator.

    python3 bench/probes/torchmp_steps.py [--reps N] [--bytes B]

The sender times its reducer (``reduce_tensor``: the storage's share and, with poolipc, the
interprocess event) and the queue's put; the receiver its rebuild (``rebuild_cuda_tensor``)
split into the storage's open, the event's open and wait, and the tensor's making, then the
write, the synchronize and the drop of the tensor (with poolipc: the release). Each line is the
median and the 90th percentile in microseconds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torchmp_share import start  # noqa: E402

T: dict[str, list[float]] = defaultdict(list)


def timed(name: str, f):
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            T[name].append((time.perf_counter() - t) * 1e6)

    return g


def summary() -> dict[str, tuple[float, float]]:
    out = {}
    for k, v in T.items():
        v = sorted(v[5:]) or sorted(v)
        out[k] = (statistics.median(v), v[int(len(v) * 0.9)])
    return out


def patch(backend: str) -> None:
    import torch

    us = torch.UntypedStorage
    share, new = us._share_cuda_, us._new_shared_cuda
    us._share_cuda_ = timed("send: storage share", share)
    us._new_shared_cuda = timed("recv: storage open (incl. event wait)", new)
    ev = torch.cuda.Event
    ev.from_ipc_handle = timed("recv: event from_ipc_handle", ev.from_ipc_handle)
    ev.ipc_handle = timed("send: event ipc_handle", ev.ipc_handle)
    ev.record = timed("send: event record", ev.record)
    if backend == "poolipc":
        from poolipc import _native, torch_sharing

        torch_sharing._native = type("N", (), {})()
        for name in dir(_native):
            if not name.startswith("__"):
                setattr(torch_sharing._native, name, getattr(_native, name))
        torch_sharing._native._share = timed("send: poolipc _share", _native._share)
        torch_sharing._native._open = timed("recv: poolipc _open", _native._open)
        torch_sharing._native._release = timed("recv: poolipc _release", _native._release)
        as_tensor = torch.as_tensor
        torch_sharing._torch = lambda: _Torch(torch, as_tensor)


class _Torch:
    """torch, with ``as_tensor`` timed (what torch_sharing builds the storage with)."""

    def __init__(self, torch, as_tensor):
        self._t = torch
        self.as_tensor = timed("recv: torch.as_tensor(mapping)", as_tensor)

    def __getattr__(self, k):
        return getattr(self._t, k)


def worker(backend, q_in, q_out):
    import torch
    import torch.multiprocessing.reductions as red

    torch.cuda.init()
    if backend == "poolipc":
        import poolipc

        poolipc.torch_sharing.enable()
    patch(backend)
    red.rebuild_cuda_tensor = timed("recv: rebuild_cuda_tensor", red.rebuild_cuda_tensor)
    while True:
        t0 = time.perf_counter()
        t = q_in.get()
        T["recv: queue get (wait + unpickle)"].append((time.perf_counter() - t0) * 1e6)
        if t is None:
            q_out.put(summary())
            return
        a = time.perf_counter()
        t[0] = 42
        torch.cuda.synchronize()
        b = time.perf_counter()
        q_out.put(1)
        c = time.perf_counter()
        del t
        d = time.perf_counter()
        T["recv: write + synchronize"].append((b - a) * 1e6)
        T["recv: reply put"].append((c - b) * 1e6)
        T["recv: drop the tensor (release)"].append((d - c) * 1e6)


def run(backend: str, reps: int, nbytes: int) -> None:
    torch, q_in, q_out, p = start(backend, worker, backend)
    patch(backend)
    from multiprocessing.reduction import ForkingPickler

    for cls, r in list(ForkingPickler._extra_reducers.items()):
        if cls is torch.Tensor or (isinstance(cls, type) and issubclass(cls, torch.Tensor)):
            ForkingPickler.register(cls, timed("send: reduce_tensor", r))
    t = torch.zeros(nbytes // 4, device="cuda")
    for i in range(reps):
        t[0] = 0
        torch.cuda.synchronize()
        a = time.perf_counter()
        q_in.put(t)
        b = time.perf_counter()
        q_out.get(timeout=120)
        c = time.perf_counter()
        T["send: put"].append((b - a) * 1e6)
        T["round trip"].append((c - a) * 1e6)
        if i % 50 == 0 and float(t[0].item()) != 42.0:
            raise SystemExit(f"{backend}: the worker's write is missing")
    q_in.put(None)
    theirs = q_out.get(timeout=120)
    p.join(60)
    mine = summary()
    mine.update(theirs)
    print(json.dumps({"backend": backend, "bytes": nbytes, "steps": mine}), flush=True)


def main() -> int:
    reps = 300
    nbytes = 4096
    if "--reps" in sys.argv:
        reps = int(sys.argv[sys.argv.index("--reps") + 1])
    if "--bytes" in sys.argv:
        nbytes = int(sys.argv[sys.argv.index("--bytes") + 1])
    if len(sys.argv) > 2 and sys.argv[1] == "--backend":
        run(sys.argv[2], reps, nbytes)
        return 0
    got = {}
    for backend in ("torch", "poolipc"):
        r = subprocess.run(
            [sys.executable, __file__, "--backend", backend, "--reps", str(reps), "--bytes", str(nbytes)],
            capture_output=True, text=True, timeout=600,
        )
        if r.returncode:
            sys.stderr.write(r.stderr[-3000:])
            print(f"FAIL {backend}: exit {r.returncode}")
            return 1
        for line in r.stdout.splitlines():
            if line.startswith("{"):
                got[backend] = json.loads(line)["steps"]
    names = sorted(set(got.get("torch", {})) | set(got.get("poolipc", {})))
    print(f"{'step (µs: median / p90)':44} {'torch native':>18} {'poolipc async':>18}")
    for n in names:
        cells = []
        for b in ("torch", "poolipc"):
            v = got.get(b, {}).get(n)
            cells.append(f"{v[0]:8.1f} /{v[1]:8.1f}" if v else f"{'-':>18}")
        print(f"{n:44} {cells[0]:>18} {cells[1]:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
