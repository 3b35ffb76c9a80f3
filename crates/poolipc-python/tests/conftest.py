"""Shared fixtures. The suite in test_sim.py runs on the simulated driver (POOLIPC_DRIVER=sim):
real processes, real sockets, real FDs, no GPU and no torch."""

import os
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
WORKERS = HERE / "workers"
REPO = HERE.parents[2]


@pytest.fixture
def report(tmp_path):
    """A path a worker appends JSON lines to, and a reader for them."""
    path = tmp_path / "report.jsonl"

    class Report:
        env = {"POOLIPC_TEST_REPORT": str(path)}

        @staticmethod
        def lines():
            import json

            if not path.exists():
                return []
            return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

    return Report


def py_worker_argv():
    return [sys.executable, str(WORKERS / "py_worker.py")]


def poolipc_binary():
    """The `poolipc` binary (its hidden `__demo-worker` is the Rust echo worker)."""
    env = os.environ.get("POOLIPC_BIN")
    if env:
        return env
    # The newest build: a stale one may not speak this build's simulated machine layout.
    built = [REPO / "target" / profile / "poolipc" for profile in ("release", "debug")]
    built = [p for p in built if p.exists()]
    if built:
        return str(max(built, key=lambda p: p.stat().st_mtime))
    bundle = REPO / "target" / "gpu-bundle" / "poolipc"
    return str(bundle) if bundle.exists() else None
