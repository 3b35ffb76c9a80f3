"""Is a write to received CUDA memory slow the first time or every time, and does it matter
whether the sender wrote it just before? A 4 KiB tensor put on an mp.Queue 200 times (the
same storage; with ``--sender-writes`` the sender writes one element and synchronizes before
each put, as bench/torchmp_share.py does); the receiver times a write and synchronize on it
twice, then one on a tensor of its own, each round; poolipc under cudaMallocAsync beside
torch's own IPC under its native allocator, each twice.

    python3 bench/probes/torchmp_touch.py [--sender-writes]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torchmp_share import start  # noqa: E402


def worker(q_in, q_out):
    import torch

    torch.cuda.init()
    own = torch.zeros(1024, device="cuda")
    rows = []
    while True:
        t = q_in.get()
        if t is None:
            break
        r = []
        for x in (t, t, own):
            a = time.perf_counter()
            x[0] = 42
            torch.cuda.synchronize()
            r.append((time.perf_counter() - a) * 1e6)
        rows.append(r)
        q_out.put(1)
        del t
    stats = {}
    try:
        import poolipc

        stats = dict(poolipc.torch_sharing.stats())
    except Exception:
        pass
    q_out.put(([statistics.median(x[i] for x in rows[10:]) for i in range(3)], stats))


def run(backend: str) -> None:
    torch, q_in, q_out, p = start(backend, worker)
    t = torch.zeros(1024, device="cuda")
    for _ in range(200):
        if os.environ.get("TOUCH_SENDER_WRITES"):
            t[0] = 0
        torch.cuda.synchronize()
        q_in.put(t)
        q_out.get(timeout=60)
    q_in.put(None)
    (first, second, own), stats = q_out.get(timeout=60)
    p.join(30)
    print(f"{backend:8} write+sync on the received tensor: first {first:6.1f} us, second {second:6.1f} us; on its own tensor {own:6.1f} us; receiver {stats}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--backend":
        run(sys.argv[2])
    else:
        env = dict(os.environ)
        if "--sender-writes" in sys.argv:
            env["TOUCH_SENDER_WRITES"] = "1"
        for b in ("torch", "poolipc", "torch", "poolipc"):
            subprocess.run([sys.executable, __file__, "--backend", b], timeout=120, check=False, env=env)
