"""In-place writes into lent inputs on every rung a torch tensor takes on the GPU:
a torch worker adds 1 in place; the parent must see it (writable), or the job must fail
(read_only, where the rung can refuse the write). Pool pointer: 64 MiB; arena copy: 4.5 GiB
(over the 4 GiB import limit). Prints one line per case and exits 1 if a write vanished.

    python3 bench/inplace.py
"""

import os
import sys
import time

import poolipc

poolipc.install_pool()
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    p = poolipc.Parent(0)
    w = p.spawn_python(os.path.join(HERE, "inplace_worker.py"))
    bad = 0
    for name, n in (("pool pointer", 64 << 20), ("arena copy", 4608 << 20)):
        for read_only in (False, True):
            x = torch.full((n,), 3, dtype=torch.uint8, device="cuda")
            t0 = time.perf_counter()
            try:
                h = p.submit(w, [x], read_only=read_only)
                h.wait()
                outcome = "completed"
            except poolipc.PoolipcError as e:
                outcome = f"raised {type(e).__name__}: {str(e)[:160]}"
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            rung = getattr(h, "input_rungs", None)
            seen = int(x[0].item()), int(x[-1].item())
            if not read_only:
                verdict = "OK: the parent sees the write" if seen == (4, 4) and outcome == "completed" else "LOST"
            elif outcome != "completed":
                verdict = "OK: refused loudly" + (" (tensor unchanged)" if seen == (3, 3) else f" (tensor {seen})")
            elif seen == (4, 4):
                verdict = "written through (pool pointer: the caller's own memory, documented)"
            else:
                verdict = "LOST SILENTLY"
            if verdict.startswith("LOST"):
                bad += 1
            print(f"{name:13} read_only={read_only!s:5} rungs={rung} {outcome}; first/last byte {seen}; {ms:.1f} ms: {verdict}", flush=True)
            del x
            if outcome != "completed":
                try:
                    p.stop(w)
                except poolipc.PoolipcError:
                    pass
                w = p.spawn_python(os.path.join(HERE, "inplace_worker.py"))
    # Host staging: memory of the device's default pool, which no worker can import (as
    # under --disable-cuda-malloc); the torch worker writes its private copy, which comes back.
    for read_only in (False, True):
        n = 16 << 20
        buf = p.alloc(n, shared=False)
        p.fill(buf.ptr, n, 3)
        h = p.submit(w, [poolipc.TensorRef(buf.ptr, "uint8", [n])], read_only=read_only)
        try:
            h.wait()
            outcome = "completed"
        except poolipc.PoolipcError as e:
            outcome = f"raised {type(e).__name__}: {str(e)[:160]}"
        got = p.read(buf.ptr, n, stream=0)
        seen = got[0], got[-1]
        if not read_only:
            verdict = "OK: the parent sees the write" if seen == (4, 4) else "LOST"
        else:
            verdict = "not copied back (read_only; the worker's private copy, documented)" if seen == (3, 3) else f"tensor {seen}"
        if verdict == "LOST":
            bad += 1
        print(f"host staging  read_only={read_only!s:5} rungs={h.input_rungs} {outcome}; first/last byte {seen}: {verdict}", flush=True)
        del buf
    p.stop(w)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
