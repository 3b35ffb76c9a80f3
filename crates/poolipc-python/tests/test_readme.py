"""The repository README's Python block runs as written, on the simulated driver: a parent and
its worker in one file, the worker's answer checked by the block itself."""

import os
import re
import subprocess
import sys

from conftest import REPO


def python_blocks(text):
    """The fenced ```python blocks of a Markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


def test_the_readme_python_program_runs_and_every_python_block_compiles(tmp_path):
    blocks = python_blocks((REPO / "README.md").read_text())
    assert blocks, "the README should show a Python program"
    # The later blocks need torch on a GPU (torch.multiprocessing): they must at least be
    # Python; the first, the parent and worker, runs here.
    for i, b in enumerate(blocks[1:], start=2):
        compile(b, f"README.md python block {i}", "exec")
    script = tmp_path / "readme_example.py"
    script.write_text(blocks[0])
    env = dict(os.environ, POOLIPC_DRIVER="sim")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "lent by pool pointer" in out.stdout, out.stdout


def test_blocks_are_found_only_where_fenced_as_python():
    text = "```sh\npip install x\n```\n```python\nprint(1)\n```\n```python\nx = 2\n```\n"
    assert python_blocks(text) == ["print(1)\n", "x = 2\n"]
