"""Shared fixtures of the pack's tests: a fake ComfyUI (`fakes/`), a stub poolipc binding
(`stubs/`), and the pack loaded the way ComfyUI loads a custom node folder. No GPU, no torch,
no ComfyUI needed."""
import atexit
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
PACK = TESTS.parent
FAKES = TESTS / "fakes"
STUBS = TESTS / "stubs"
FAKE_TORCH = TESTS / "fake_torch"

SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]

_OURS = ("comfy", "folder_paths", "server", "cuda_malloc", "poolipc", "comfyui-poolipc", "_poolipc_comfyui_startup")


def _forget_modules():
    for name in list(sys.modules):
        if name.split(".")[0] in _OURS:
            del sys.modules[name]


def load_pack():
    """As ComfyUI's load_custom_node: the folder as a package named after it."""
    spec = importlib.util.spec_from_file_location(
        "comfyui-poolipc", PACK / "__init__.py", submodule_search_locations=[str(PACK)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["comfyui-poolipc"] = module
    spec.loader.exec_module(module)
    return module


def set_startup(mode, device=0, reason=None):
    """What the prestartup script records for the nodes."""
    import types

    state = types.ModuleType("_poolipc_comfyui_startup")
    state.mode, state.device, state.reason = mode, device, reason
    sys.modules["_poolipc_comfyui_startup"] = state


@pytest.fixture
def comfy(tmp_path, monkeypatch):
    """A fake ComfyUI process with poolipc enabled and installed on device 0, a worker file
    naming `sleeper`, and the pack loaded. Yields the pack; stops its workers afterwards."""
    _forget_modules()
    for p in (str(FAKES), str(STUBS)):
        monkeypatch.syspath_prepend(p)
    user = tmp_path / "user"
    user.mkdir()
    monkeypatch.setenv("FAKE_COMFY_USER_DIR", str(user))
    monkeypatch.setenv("POOLIPC_ENABLE", "1")
    workers = tmp_path / "workers.json"
    workers.write_text(json.dumps({"workers": {"sleeper": SLEEPER}}))
    monkeypatch.setenv("POOLIPC_WORKERS_FILE", str(workers))
    import poolipc

    poolipc.Parent.instances.clear()
    poolipc.Parent.return_rungs_supported = True
    poolipc.INSTALLS.clear()
    set_startup("installed", 0)
    pack = load_pack()
    registry = sys.modules["comfyui-poolipc.nodes"].REGISTRY
    yield pack
    registry.stop_all("test over")
    atexit.unregister(registry.stop_all)
    _forget_modules()


def process_gone(pid, timeout=10.0):
    """True once `pid` no longer runs (gone, or a zombie nobody reaped)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except OSError:
            return True
        if state in (b"Z", b"X"):
            return True
        time.sleep(0.05)
    return False


def subprocess_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("POOLIPC_", "FAKE_COMFY_"))}
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES", "PYTHONPATH"):
        env.pop(k, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env
