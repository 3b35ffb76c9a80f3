"""torch.multiprocessing under backend:cudaMallocAsync on the GPU, with poolipc's sharing
(poolipc.torch_sharing) and, as the control, without it. Each scenario runs in a fresh
interpreter (workers/torchmp_scenarios.py), since the pool must be installed before torch:

    PYTHONPATH=/tmp/site python3 -m pytest -v crates/poolipc-python/tests/gpu_torchmp_test.py

Skips without torch, without CUDA, or on POOLIPC_DRIVER=sim. POOLIPC_TORCHMP_MANY sets the
count of the A -> B -> C run (100 000 by default).
"""

import importlib.util
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed: these tests need torch on a GPU machine", allow_module_level=True)
if os.environ.get("POOLIPC_DRIVER", "cuda") == "sim":
    pytest.skip("POOLIPC_DRIVER=sim: these tests need the GPU", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = os.path.join(HERE, "workers", "torchmp_scenarios.py")
SIM = os.path.join(HERE, "workers", "sharing_sim.py")


def _cuda() -> bool:
    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                       capture_output=True, text=True, timeout=120)
    return r.stdout.strip() == "True"


if not _cuda():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)


def _run(name: str, mode: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = dict(os.environ, POOLIPC_TORCHMP_MODE=mode, PYTHONUNBUFFERED="1")
    if mode == "control":
        env["POOLIPC_TORCHMP_TIMEOUT"] = "60"
    try:
        return subprocess.run([sys.executable, SCENARIOS, name], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return subprocess.CompletedProcess(e.cmd, -9, out, err + f"\ntimed out after {timeout} s")


WORKS = ["queue", "many", "pool_map", "producer_deletes", "sigkill", "process_arg", "channels",
         "event", "direct", "types", "ipc_event"]
# ipc_event is torch's own event sharing: it works without poolipc too (no control).
FAILS_WITHOUT = [n for n in WORKS if n != "ipc_event"] + ["big4", "big6"]
BIG = ["big4", "big6"]

# Every scenario runs in interpreters of its own (torch and a child or two each: seconds to
# start), so they run POOLIPC_TORCHMP_JOBS at a time (8 by default; the GPU's memory holds
# them, the 6 GiB one and its copy included) and each test reads its result: the whole file
# takes minutes, not a quarter of an hour, and the scenarios meet each other on the GPU as a
# user's processes would.
_RUNS: dict[tuple[str, str], "concurrent.futures.Future[subprocess.CompletedProcess]"] = {}


def _all_runs() -> list[tuple[str, str]]:
    return ([(n, "poolipc") for n in WORKS + BIG] + [(n, "control") for n in FAILS_WITHOUT]
            + [("unpooled", "unpooled")])


def scenario(name: str, mode: str) -> subprocess.CompletedProcess:
    import concurrent.futures

    if not _RUNS:
        pool = concurrent.futures.ThreadPoolExecutor(int(os.environ.get("POOLIPC_TORCHMP_JOBS", "8")))
        for key in _all_runs():
            _RUNS[key] = pool.submit(_run, *key)
    fut = _RUNS.get((name, mode)) or concurrent.futures.ThreadPoolExecutor(1).submit(_run, name, mode)
    r = fut.result()
    print(r.stdout[-4000:])
    print(r.stderr[-4000:], file=sys.stderr)
    return r


@pytest.mark.parametrize("name", WORKS)
def test_with_poolipc(name):
    r = scenario(name, "poolipc")
    assert r.returncode == 0 and f"PASS {name}" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.parametrize("name", FAILS_WITHOUT)
def test_control_fails_without_poolipc(name):
    r = scenario(name, "control")
    assert r.returncode != 0, f"{name} passed without poolipc: the test proves nothing\n{r.stdout}"
    assert "cudaMallocAsync does not yet support" in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("name", BIG)
def test_large_tensors_cross_by_pointer_or_as_a_copy(name):
    r = scenario(name, "poolipc")
    assert r.returncode == 0 and f"PASS {name}" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_unpooled_tensor_is_a_clear_error():
    r = scenario("unpooled", "unpooled")
    assert r.returncode == 0 and "PASS unpooled" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.parametrize("name", ["basic", "again", "channels", "dying", "relay", "copy", "unpooled"])
def test_torch_free_sharing_on_the_gpu(name):
    r = subprocess.run([sys.executable, SIM, name], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, POOLIPC_DRIVER="cuda"))
    assert r.returncode == 0 and f"PASS {name}" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
