"""The real-ComfyUI run (``tests/real/``, run on a GPU machine) against the pack as it is: the
workflow ``drive.py`` posts names the pack's node classes, inputs and outputs correctly, and
the scripts parse. The run itself needs a GPU and ComfyUI; see tests/real/README.md."""
import importlib.util
import py_compile
import shutil
import subprocess
import sys

import pytest

from conftest import TESTS

REAL = TESTS / "real"


def drive():
    spec = importlib.util.spec_from_file_location("poolipc_real_drive", REAL / "drive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_workflow_matches_the_pack_nodes(comfy):
    wf = drive().workflow("in.png", "sleeper", "p")
    mappings = comfy.NODE_CLASS_MAPPINGS
    produced = {"1": ("IMAGE", "MASK")}  # LoadImage, ComfyUI's own
    for node_id in ("2", "3"):
        cls = mappings[wf[node_id]["class_type"]]
        required = cls.INPUT_TYPES()["required"]
        inputs = wf[node_id]["inputs"]
        assert set(inputs) == set(required), (node_id, inputs, required)
        for name, value in inputs.items():
            if isinstance(value, list):  # a link: [node id, output index], of the right type
                assert produced[value[0]][value[1]] == required[name][0], (node_id, name)
            else:  # a combo: one of its choices
                assert value in required[name][0], (node_id, name, value)
        produced[node_id] = cls.RETURN_TYPES
    assert wf["4"]["class_type"] == "SaveImage" and produced["3"][wf["4"]["inputs"]["images"][1]] == "IMAGE"


def test_the_scripts_parse(tmp_path):
    py_compile.compile(str(REAL / "drive.py"), cfile=str(tmp_path / "drive.pyc"), doraise=True)
    for script in ("run.sh", "make_bundle.sh"):
        subprocess.run(["bash", "-n", str(REAL / script)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    subprocess.run(["shellcheck", str(REAL / "run.sh"), str(REAL / "make_bundle.sh")], check=True)


def test_the_expected_inverse_follows_comfyuis_float32_steps(tmp_path):
    np = pytest.importorskip("numpy")
    pytest.importorskip("PIL")
    d = drive()
    assert d.make_image(str(tmp_path / "a.png")) == 0
    src, exp, plain = d.expected_inverse(str(tmp_path / "a.png"))
    assert sorted(set(src[..., 0].ravel().tolist())) == list(range(256))
    assert np.abs(exp.astype(int) - plain.astype(int)).max() <= 1  # truncation, at most one off
    assert (exp[src == 0] == 255).all() and (exp[src == 255] == 0).all()
