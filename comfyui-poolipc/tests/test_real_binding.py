"""The pack on the real poolipc binding and its simulated driver (POOLIPC_DRIVER=sim, no GPU,
no torch), each case in a fresh interpreter. Skipped when the binding is not importable
(build it: `maturin build -m crates/poolipc-python/Cargo.toml` and pip install the wheel, or
`cargo xtask ci`, which installs it into target/pyenv)."""
import inspect
import json
import subprocess
import sys

import pytest

from conftest import FAKE_TORCH, FAKES, PACK, TESTS, process_gone, subprocess_env
from test_prestartup import comfy_start, installs


def _real_binding_importable():
    p = subprocess.run(
        [sys.executable, "-c", "import poolipc, sys; sys.exit(3 if getattr(poolipc, 'STUB', False) else 0)"],
        env=subprocess_env(POOLIPC_DRIVER="sim"),
        capture_output=True,
        text=True,
    )
    return p.returncode == 0, (p.stderr.strip().splitlines() or ["stub"])[-1]


_OK, _WHY = _real_binding_importable()
pytestmark = pytest.mark.skipif(not _OK, reason=f"the real poolipc binding is not importable here ({_WHY})")

SIM = {"POOLIPC_ENABLE": "1", "POOLIPC_DRIVER": "sim"}


@pytest.mark.parametrize("order", ["new", "old"])
def test_the_real_binding_installs_in_a_comfyui_startup(tmp_path, order):
    out, err, state = comfy_start(tmp_path, order, env=SIM, binding=None)
    assert len(installs(err)) == 1 and "as device 0's current pool" in err, err
    assert state["mode"] == "installed"


def test_the_real_binding_is_not_installed_under_disable_cuda_malloc(tmp_path):
    out, err, state = comfy_start(tmp_path, "new", "--disable-cuda-malloc", env=SIM, binding=None)
    assert installs(err) == [] and "host staging" in err
    assert state["mode"] == "host-staging"


SCENARIO = """
import json, logging, os, signal, sys, time
logging.basicConfig(level=logging.INFO)
sys.path[:0] = [{fakes!r}, {tests!r}]
import poolipc
poolipc.install_pool(0)
from conftest import load_pack, set_startup
set_startup("installed", 0)
load_pack()
nodes = sys.modules["comfyui-poolipc.nodes"]
import comfy.model_management as mm
start = lambda: nodes.PoolipcStartWorker().start("sim", unique_id="5")[0]
pid = lambda h: h.registry.acquire(h)[2]
h = start(); first = pid(h)
h = start(); second = pid(h)
os.kill(second, signal.SIGKILL); time.sleep(0.5)
third = pid(h)
mm.unload_all_models()
print("PIDS " + json.dumps([first, second, third, nodes.REGISTRY.running()]))
"""


def test_on_the_real_binding_workers_are_replaced_respawned_and_freed(tmp_path):
    (tmp_path / "w.json").write_text(json.dumps({"workers": {"sim": ["{python}", str(TESTS / "sim_worker.py")]}}))
    (tmp_path / "user").mkdir()
    env = subprocess_env(**SIM, POOLIPC_WORKERS_FILE=tmp_path / "w.json", FAKE_COMFY_USER_DIR=tmp_path / "user")
    code = SCENARIO.format(fakes=str(FAKES), tests=str(TESTS))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    first, second, third, running = json.loads(p.stdout.split("PIDS ", 1)[1])
    assert len({first, second, third}) == 3
    assert all(process_gone(x) for x in (first, second, third))
    assert running == {}
    assert "had died; started a new one" in p.stderr


ENVIRON = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)
sys.path[:0] = [{fakes!r}, {tests!r}]
import poolipc
poolipc.install_pool(0)
from conftest import load_pack, set_startup
set_startup("installed", 0)
load_pack()
nodes = sys.modules["comfyui-poolipc.nodes"]
import comfy.model_management as mm
for i, name in enumerate(["plain", "hf", "all"]):
    h = nodes.PoolipcStartWorker().start(name, unique_id=str(i))[0]
    h.registry.acquire(h)
mm.unload_all_models()
print("DONE")
"""

ENV_WORKER = (
    "import json, os, poolipc; "
    "open(os.environ['ENV_REPORT'], 'w').write(json.dumps(sorted(os.environ))); "
    "[j.finish() for j in poolipc.Worker()]"
)


def test_on_the_real_binding_comfyuis_api_keys_do_not_reach_a_worker(tmp_path):
    def worker(name, **extra):
        return {"argv": ["{python}", "-c", ENV_WORKER], "env": {"ENV_REPORT": str(tmp_path / name)}, **extra}

    (tmp_path / "w.json").write_text(json.dumps({"workers": {
        "plain": worker("plain"),
        "hf": worker("hf", env_allowlist=["HF_TOKEN_FOR_TEST"]),
        "all": worker("all", env_allowlist="*"),
    }}))
    (tmp_path / "user").mkdir()
    env = subprocess_env(**SIM, POOLIPC_WORKERS_FILE=tmp_path / "w.json", FAKE_COMFY_USER_DIR=tmp_path / "user",
                         FAKE_API_KEY_FOR_TEST="sk-secret", HF_TOKEN_FOR_TEST="hf-token")
    code = ENVIRON.format(fakes=str(FAKES), tests=str(TESTS))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "DONE" in p.stdout, p.stdout + p.stderr
    got = {n: set(json.loads((tmp_path / n).read_text())) for n in ("plain", "hf", "all")}
    assert "FAKE_API_KEY_FOR_TEST" not in got["plain"] and "HF_TOKEN_FOR_TEST" not in got["plain"]
    assert "FAKE_API_KEY_FOR_TEST" not in got["hf"] and "HF_TOKEN_FOR_TEST" in got["hf"]
    assert {"FAKE_API_KEY_FOR_TEST", "HF_TOKEN_FOR_TEST"} <= got["all"]
    assert {"PATH", "ENV_REPORT", "POOLIPC_DRIVER"} <= got["plain"]


def comfy_cuda_free_memory(torch, dev):
    """ComfyUI's free-VRAM figure: `get_free_memory(dev, torch_free_too=True)` of
    `comfy/model_management.py`, its CUDA branch (the one cudaMallocAsync takes), copied
    unchanged from comfyanonymous/ComfyUI at commit 00184d155ba67ba6e9579bd7ef2ede93217a3520."""
    # --- ComfyUI's lines ---
    stats = torch.cuda.memory_stats(dev)
    mem_active = stats['active_bytes.all.current']
    mem_reserved = stats['reserved_bytes.all.current']
    mem_free_cuda, _ = torch.cuda.mem_get_info(dev)
    mem_free_torch = mem_reserved - mem_active
    mem_free_total = mem_free_cuda + mem_free_torch
    # --- end of ComfyUI's lines ---
    return (mem_free_total, mem_free_torch)


# The real binding on SimDriver installs the pool, then the fake torch (torch 2.11's wiring of
# the memory figures; its device-level free memory fixed at 40 GiB) is imported, the pool keeps
# 512 MiB freed and 256 MiB live, and ComfyUI's lines run on ComfyUI's device.
FREE_MEMORY = """
import json, sys
sys.path[:0] = [{fakes!r}, {fake_torch!r}]
import poolipc
poolipc.install_pool(0)
import torch.cuda
import comfy.model_management as mm
{formula}
parent = poolipc.Parent(0)
live = parent.alloc(256 << 20)
freed = parent.alloc(512 << 20)
del freed
parent.synchronize(0)
free_total, free_torch = comfy_cuda_free_memory(torch, mm.get_torch_device())
pool = poolipc.memory_stats()
print("FREE " + json.dumps({{"total": free_total, "torch": free_torch, "pool": pool,
                             "cuda": torch.cuda.mem_get_info(0)[0]}}))
"""


def comfy_free_memory(tmp_path, **env):
    code = FREE_MEMORY.format(fakes=str(FAKES), fake_torch=str(FAKE_TORCH),
                              formula=inspect.getsource(comfy_cuda_free_memory))
    p = subprocess.run([sys.executable, "-c", code], env=subprocess_env(**SIM, **env),
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.split("FREE ", 1)[1])


def test_comfyuis_free_memory_counts_the_pools_unused_reserve(tmp_path):
    got = comfy_free_memory(tmp_path)
    pool = got["pool"]
    unused = pool["reserved_current"] - pool["used_current"]
    assert unused >= 512 << 20, pool
    assert got["torch"] == unused
    assert got["total"] == got["cuda"] + unused


def test_with_POOLIPC_TORCH_STATS_0_comfyuis_free_memory_misses_the_pools_reserve(tmp_path):
    got = comfy_free_memory(tmp_path, POOLIPC_TORCH_STATS="0")
    assert got["pool"]["reserved_current"] - got["pool"]["used_current"] >= 512 << 20
    assert got["torch"] == 0 and got["total"] == got["cuda"]
