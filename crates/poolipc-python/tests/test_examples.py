"""The README's Python example runs as written (examples/handoff_parent.py and its worker)."""

import os
import pathlib
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def test_the_handoff_example_runs_on_the_simulated_driver():
    env = dict(os.environ, POOLIPC_DRIVER="sim")
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "handoff_parent.py")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "got them doubled" in out.stdout
    assert "by pool pointer" in out.stdout
