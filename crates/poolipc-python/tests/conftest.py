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


def rogue_binary():
    """The test crate's rogue worker (`poolipc-test-rogue`, built with the Rust tests), the
    newest build, or the GPU bundle's; None where none was built."""
    env = os.environ.get("POOLIPC_TEST_ROGUE_BIN")
    if env:
        return env
    built = [REPO / "target" / profile / "poolipc-test-rogue" for profile in ("release", "debug")]
    built.append(REPO / "target" / "gpu-bundle" / "tests" / "poolipc-test-rogue")
    built = [p for p in built if p.exists()]
    return str(max(built, key=lambda p: p.stat().st_mtime)) if built else None


def run_in_child_pytest(test_file, request, env_extra):
    """Runs the calling test alone in a child pytest of `test_file` (a fresh interpreter, so a
    fresh process-wide parent), on SimDriver, with `env_extra` added to its environment;
    fails with the child's output unless exactly that one test passed."""
    import subprocess

    env = dict(os.environ, POOLIPC_DRIVER="sim", **env_extra)
    nodeid = f"{os.path.basename(test_file)}::{request.node.name}"
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", nodeid],
        cwd=HERE, env=env, capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, f"the child run of {nodeid} failed:\n{p.stdout}\n{p.stderr}"
    assert "1 passed" in p.stdout, p.stdout


def _libcuda():
    """libcuda through ctypes, loaded at first use (the GPU tests' only: SimDriver runs have
    none)."""
    import ctypes

    global _LIBCUDA
    if _LIBCUDA is None:
        _LIBCUDA = ctypes.CDLL("libcuda.so.1")
    return _LIBCUDA


_LIBCUDA = None
CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE = 17


def pool_of(ptr):
    """The memory pool a device pointer was allocated from (cuPointerGetAttribute)."""
    import ctypes

    h = ctypes.c_void_p()
    assert _libcuda().cuPointerGetAttribute(ctypes.byref(h), CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ctypes.c_uint64(ptr)) == 0
    return h.value


def device_pools(device=0):
    """(current pool, default pool) of `device`."""
    import ctypes

    cur, dflt = ctypes.c_void_p(), ctypes.c_void_p()
    assert _libcuda().cuDeviceGetMemPool(ctypes.byref(cur), device) == 0
    assert _libcuda().cuDeviceGetDefaultMemPool(ctypes.byref(dflt), device) == 0
    return cur.value, dflt.value
