"""The prestartup script inside a fake ComfyUI startup, each in a fresh interpreter: both
orders of ComfyUI's main.py (prestartup scripts after its device and cuda_malloc handling, as
today, or before, as older ComfyUI), ComfyUI's own flags, and another pack that imported torch
first. A fake torch prints what it saw when imported; the stub binding prints the device and
CUDA_VISIBLE_DEVICES it would have initialised CUDA with."""
import json
import os
import subprocess
import sys

import pytest

from conftest import FAKE_TORCH, FAKES, PACK, STUBS, TESTS, subprocess_env

ORDERS = ["new", "old"]


def comfy_start(tmp_path, order, *flags, env=None, packs=None, binding=STUBS):
    """Start the fake ComfyUI with the pack in custom_nodes (a link, as the README says) and
    `packs` ({folder: prestartup source}); returns (stdout, stderr, startup state)."""
    nodes = tmp_path / "custom_nodes"
    nodes.mkdir(exist_ok=True)
    if not (nodes / "comfyui-poolipc").exists():
        (nodes / "comfyui-poolipc").symlink_to(PACK)
    for name, source in (packs or {}).items():
        (nodes / name).mkdir()
        (nodes / name / "prestartup_script.py").write_text(source)
    path = [str(FAKES), str(FAKE_TORCH)] + ([str(binding)] if binding else [])
    e = subprocess_env(FAKE_COMFY_ORDER=order, FAKE_COMFY_CUSTOM_NODES=nodes, PYTHONPATH=os.pathsep.join(path))
    e.update({k: str(v) for k, v in (env or {}).items()})
    p = subprocess.run(
        [sys.executable, str(FAKES / "main.py"), *flags], env=e, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stdout + p.stderr
    state = json.loads(p.stdout.split("STATE ", 1)[1])
    return p.stdout, p.stderr, state


def torch_saw(out):
    line = next(x for x in out.splitlines() if x.startswith("TORCH IMPORTED"))
    cvd, conf = line.removeprefix("TORCH IMPORTED ").split(" ")
    return cvd.split("=", 1)[1], conf.split("=", 1)[1]


def installs(err):
    return [x for x in err.splitlines() if "installed a shareable CUDA memory pool" in x]


ON = {"POOLIPC_ENABLE": "1"}


@pytest.mark.parametrize("order", ORDERS)
def test_without_opt_in_the_prestartup_does_nothing_and_says_nothing(tmp_path, order):
    out, err, state = comfy_start(tmp_path, order, "--cuda-device", "1")
    assert "poolipc" not in err and state["mode"] == "off"
    assert torch_saw(out)[0] == "1"  # ComfyUI's own doing, in both orders


@pytest.mark.parametrize("order", ORDERS)
def test_a_plain_start_installs_on_device_0_before_torch(tmp_path, order):
    out, err, state = comfy_start(tmp_path, order, env=ON)
    assert len(installs(err)) == 1 and "as device 0's current pool" in err
    assert state == {"mode": "installed", "device": 0, "reason": None, "mps": None}
    assert "backend:cudaMallocAsync" in torch_saw(out)[1]
    assert "Torch already imported" not in err


@pytest.mark.parametrize("order", ORDERS)
def test_POOLIPC_ISOLATED_installs_a_parent_whose_workers_get_no_handle_on_its_memory(tmp_path, order):
    out, err, state = comfy_start(tmp_path, order, env={**ON, "POOLIPC_ISOLATED": "1"})
    (line,) = installs(err)
    assert "isolated=True" in line, line
    assert state["mode"] == "installed"
    _, err, _ = comfy_start(tmp_path, order, env=ON)
    assert "isolated" not in installs(err)[0]


@pytest.mark.parametrize("order", ORDERS)
def test_cuda_device_sets_CUDA_VISIBLE_DEVICES_before_the_pool_and_torch(tmp_path, order):
    out, err, state = comfy_start(tmp_path, order, "--cuda-device", "1", env={**ON, "POOLIPC_DEVICE": "3"})
    # the pool: on device 0 of what ComfyUI makes visible, CUDA initialised after the variable
    (line,) = installs(err)
    assert "as device 0's current pool" in line and "CUDA_VISIBLE_DEVICES=1)" in line
    assert "ComfyUI's --cuda-device 1" in err and "POOLIPC_DEVICE=3 is ignored" in err
    assert torch_saw(out)[0] == "1"
    assert state["mode"] == "installed" and state["device"] == 0


@pytest.mark.parametrize("order", ORDERS)
def test_default_device_orders_the_devices_as_comfyui_does(tmp_path, order):
    out, err, state = comfy_start(tmp_path, order, "--default-device", "2", env=ON)
    (line,) = installs(err)
    assert "CUDA_VISIBLE_DEVICES=2,0,1,3," in line and "as device 0's" in line
    assert torch_saw(out)[0].startswith("2,0,1,3,")


@pytest.mark.parametrize("order", ORDERS)
def test_POOLIPC_DEVICE_applies_only_without_comfyuis_device_flags(tmp_path, order):
    out, err, state = comfy_start(tmp_path, order, env={**ON, "POOLIPC_DEVICE": "2"})
    assert "as device 2's current pool" in err and "CUDA_VISIBLE_DEVICES=None" in err
    assert state["device"] == 2


@pytest.mark.parametrize("order", ORDERS)
def test_cpu_installs_nothing_and_says_why(tmp_path, order):
    out, err, state = comfy_start(tmp_path, order, "--cpu", env=ON)
    assert installs(err) == []
    # Once: before ComfyUI configures logging (mid-2024 main.py), logging's last-resort
    # handler would print a warning as well as the pack's own print.
    assert err.count("ComfyUI was started with --cpu, so there is no CUDA device") == 1, err
    assert state["mode"] == "cpu"


@pytest.mark.parametrize("order", ORDERS)
def test_disable_cuda_malloc_installs_nothing_and_says_tensors_take_host_staging(tmp_path, order):
    out, err, state = comfy_start(tmp_path, order, "--disable-cuda-malloc", env=ON)
    assert installs(err) == []
    assert "--disable-cuda-malloc" in err and "the swap has no effect" in err and "host staging" in err
    assert err.count("the swap has no effect") == 1, err
    assert torch_saw(out)[1] == "None"  # the user's choice stands
    assert state["mode"] == "host-staging"


def listed_before_us(tmp_path, source):
    """A pack whose prestartup ComfyUI runs before poolipc's: ComfyUI walks custom_nodes in
    os.listdir order, so try names until the file system lists one before ours."""
    nodes = tmp_path / "custom_nodes"
    nodes.mkdir(exist_ok=True)
    (nodes / "comfyui-poolipc").symlink_to(PACK)
    for i in range(200):
        name = f"other-pack-{i}"
        (nodes / name).mkdir()
        (nodes / name / "prestartup_script.py").write_text(source)
        listing = os.listdir(nodes)
        if listing.index(name) < listing.index("comfyui-poolipc"):
            return name
        (nodes / name / "prestartup_script.py").unlink()
        (nodes / name).rmdir()
    pytest.skip("this file system lists no other-pack-N before comfyui-poolipc")


@pytest.mark.parametrize("order", ORDERS)
def test_another_pack_that_imported_torch_first_is_named(tmp_path, order):
    culprit = listed_before_us(tmp_path, "import os\nimport torch  # the mistake\n")
    out, err, state = comfy_start(tmp_path, order, env=ON)
    assert installs(err) == []
    assert "poolipc: not enabled: torch is already imported (imported by " in err
    assert f"{culprit}/prestartup_script.py" in err
    assert "import torch later" in err and "ComfyUI starts as before" in err
    assert state["mode"] == "failed" and culprit in state["reason"]


def test_a_pack_that_ran_first_without_importing_torch_is_not_blamed(tmp_path):
    harmless = listed_before_us(tmp_path, "import os\n")
    out, err, state = comfy_start(tmp_path, "new", env={**ON, "FAKE_COMFY_TORCH_EARLY": "1"})
    assert "torch is already imported" in err
    assert "imported by" not in err
    assert f"these ran before poolipc's, one may import it through another module: " in err
    assert harmless in err


def test_torch_imported_before_any_prestartup_is_said_so(tmp_path):
    out, err, state = comfy_start(tmp_path, "new", env={**ON, "FAKE_COMFY_TORCH_EARLY": "1"})
    assert "torch is already imported (not by another pack's prestartup script" in err
    assert state["mode"] == "failed"


def test_a_missing_binding_is_logged_and_startup_goes_on(tmp_path):
    out, err, state = comfy_start(tmp_path, "new", env=ON, binding=TESTS / "no_binding")
    assert "poolipc: not enabled" in err and "pip install" in err
    assert state["mode"] == "failed" and "TORCH IMPORTED" in out


def test_flags_are_read_from_sys_argv_when_comfyui_has_not_parsed_them(tmp_path):
    # the script alone, as ComfyUI runs it, with no comfy.cli_args in the process
    code = (
        "import importlib.util, os, sys\n"
        "sys.argv = ['main.py', '--listen', '--cuda-device', '1', '--cpu-vae']\n"
        f"spec = importlib.util.spec_from_file_location('x', {str(PACK / 'prestartup_script.py')!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "assert 'comfy.cli_args' not in sys.modules\n"
        "print('CVD', os.environ.get('CUDA_VISIBLE_DEVICES'))\n"
    )
    env = subprocess_env(POOLIPC_ENABLE="1", PYTHONPATH=STUBS)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "CVD 1" in p.stdout and "as device 0's current pool" in p.stderr


@pytest.mark.parametrize("order", ORDERS)
def test_POOLIPC_MPS_starts_a_private_daemon_before_the_pool_only_when_its_value_acknowledges_the_cost(tmp_path, order):
    out, err, state = comfy_start(tmp_path, order, env={**ON, "POOLIPC_MPS": "accept-shared-gpu-faults"})
    lines = err.splitlines()
    started = next(i for i, x in enumerate(lines) if "started a private MPS daemon" in x)
    installed = next(i for i, x in enumerate(lines) if "installed a shareable CUDA memory pool" in x)
    assert started < installed, err
    assert state["mps"] == "/tmp/poolipc-mps-stub/pipe" and state["mode"] == "installed"


def test_POOLIPC_MPS_1_is_not_an_acknowledgement(tmp_path):
    out, err, state = comfy_start(tmp_path, "new", env={**ON, "POOLIPC_MPS": "1"})
    assert "started a private MPS daemon" not in err
    assert "POOLIPC_MPS=accept-shared-gpu-faults" in err and "ComfyUI itself" in err, err
    assert state["mps"] is None and state["mode"] == "installed"
