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


def test_the_readme_has_one_python_block_and_it_runs(tmp_path):
    blocks = python_blocks((REPO / "README.md").read_text())
    assert len(blocks) == 1, f"the README should show one Python program, found {len(blocks)}"
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
