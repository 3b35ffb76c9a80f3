"""The round trip by what a Python worker does with its job: one worker at a time, a 4 KiB
buffer of the pool lent again by a default `poolipc.Parent` (its canary battery on), on the GPU
(`POOLIPC_DRIVER=sim`: on the simulated driver).

Why: without MPS the canary battery took a Rust worker's 4 KiB job (a worker that does nothing)
from 286 to 21 us, the GPU's turn-taking gone, while torch workers still paid about 330 us
(H100, 2026-12-05; docs/facts.md). Which of a worker's steps brings the turn-taking back:

  nothing           take the job, finish it (no torch in the worker)
  torch imported    the same in a worker that imported torch and let it start CUDA
  torch view        torch.from_dlpack of the input, nothing else
  torch write       the same, and one element written (a kernel on the job's stream)
  torch write+sync  the same, and torch.cuda.synchronize() before the job finishes

    python3 bench/pyturns.py [--jobs 1000] [--json]

Rows that need torch are left out where this interpreter has no torch (said on stderr). Run
it plainly and under MPS (`poolipc mps -- python3 bench/pyturns.py`) to compare.
"""

from __future__ import annotations

import argparse
import json
import sys

# The median of `parent.run` after a warm-up, as pysplit measures its Python pairs (this
# directory is first on the path when the script runs).
from pysplit import python_pair

# One worker program, its behaviour picked by its first argument.
WORKER = r"""
import sys
import poolipc
kind = sys.argv[1]
if kind != "nothing":
    import torch
    torch.cuda.init()
w = poolipc.Worker()
for job in w:
    with job:
        if kind in ("nothing", "torch imported"):
            continue
        for v in job.inputs:
            t = torch.from_dlpack(v)
            if kind != "torch view":
                t.view(-1)[0] = 42
        if kind == "torch write+sync":
            torch.cuda.synchronize()
"""

KINDS = ("nothing", "torch imported", "torch view", "torch write", "torch write+sync")


def has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000, help="round trips per kind (default 1000)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.jobs < 1:
        ap.error(f"--jobs {a.jobs}: give 1 or more")
    import poolipc

    kinds = KINDS if has_torch() else KINDS[:1]
    if len(kinds) < len(KINDS):
        print("pyturns: no torch here: only the worker that does nothing", file=sys.stderr)
    parent = poolipc.Parent(0)
    buf = parent.alloc(4096, dtype="uint8", shape=[4096])
    rows = {}
    for kind in kinds:
        w = parent.spawn([sys.executable, "-c", WORKER, kind])
        try:
            rows[kind] = python_pair(parent, w, buf, a.jobs, False)
            rungs = parent.last_input_rungs
        finally:
            parent.stop(w)
        rows[kind + " rungs"] = rungs
    del buf
    if a.json:
        print(json.dumps({"driver": parent.driver, "rows": rows}))
        return 0
    print(f"4 KiB lent again, one worker at a time, {a.jobs} round trips each, {parent.driver}:")
    print(f"  {'the worker':18} {'median us':>10}  inputs took")
    for kind in kinds:
        print(f"  {kind:18} {rows[kind]:10.1f}  {', '.join(map(str, rows[kind + ' rungs']))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
