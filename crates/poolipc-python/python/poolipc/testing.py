"""Checking your program on the simulated GPU, from pytest.

``poolipc.testing`` is a pytest plugin: load it with ``pytest -p poolipc.testing`` or
``pytest_plugins = ["poolipc.testing"]`` in a ``conftest.py``. It gives

- the ``sim_checked`` fixture: the test runs on the simulated driver (``POOLIPC_DRIVER=sim``
  must be set before the process's parent is made, which the fixture checks) and fails, with
  the race checker's report in its message, if any violation was recorded while it ran, in
  this process or any worker, even where no job failed of it (a parent that read a result it
  had freed, say). The fixture's value is ``poolipc.sim_report``, to look earlier.
- ``assert_no_violations()``: the same check, for code outside pytest.

On the simulated driver a job that breaks the GPU's ordering rules also fails by itself, with
``poolipc.SimViolationError``; see docs/checking.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

import poolipc

__all__ = ["assert_no_violations", "sim_checked"]


def assert_no_violations(seen: int = 0) -> None:
    """Raises ``AssertionError`` with the race checker's report when violations past the
    first ``seen`` were recorded on the simulated machine. Does nothing on the GPU."""
    report = poolipc.sim_report()
    if report is None:
        return
    new = report.violations[seen:]
    if new:
        lines = "\n".join(f"  {i + 1}. {v}" for i, v in enumerate(new))
        plural = "" if len(new) == 1 else "s"
        raise AssertionError(
            f"the simulated GPU's race checker found {len(new)} violation{plural} (replay with "
            f"POOLIPC_SIM_SEED={report.seed}):\n{lines}")


@pytest.fixture
def sim_checked() -> Iterator[Callable[[], poolipc.SimReport | None]]:
    """Runs the test on the simulated driver and fails it on any violation (see the module
    docs). Yields ``poolipc.sim_report``."""
    if os.environ.get("POOLIPC_DRIVER") != "sim":
        pytest.fail("sim_checked needs POOLIPC_DRIVER=sim set before the parent is made "
                    "(in the environment, or at the top of conftest.py)")
    before = poolipc.sim_report()
    seen = len(before.violations) if before is not None else 0
    yield poolipc.sim_report
    assert_no_violations(seen)
