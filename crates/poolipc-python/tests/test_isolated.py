"""Isolated workers through the binding (``Parent(isolated=True)``, or one worker at a time with
``spawn(..., isolated=True)``), on the simulated driver: no handle on the parent's pool, so a
pool tensor crosses by arena copy and the result comes from the arena, with the right bytes
both ways.

The process's parent is made once, and test_sim.py's shares its pool: the test runs in a
fresh interpreter (a child pytest of this file, with POOLIPC_ISOLATED_CHILD set).
"""

import os
import struct
import sys

import pytest

os.environ.setdefault("POOLIPC_DRIVER", "sim")
if os.environ["POOLIPC_DRIVER"] != "sim":
    pytest.skip("test_isolated.py runs on the simulated driver only", allow_module_level=True)
if "torch" in sys.modules:
    pytest.skip("torch is imported in this process; run test_isolated.py in its own pytest process",
                allow_module_level=True)

import poolipc  # noqa: E402

from conftest import py_worker_argv, run_in_child_pytest  # noqa: E402

CHILD = os.environ.get("POOLIPC_ISOLATED_CHILD") == "1"


def test_an_isolated_worker_takes_a_pool_tensor_by_arena_copy_and_answers_from_the_arena(request):
    if not CHILD:
        return run_in_child_pytest(__file__, request, {"POOLIPC_ISOLATED_CHILD": "1"})
    p = poolipc.Parent(0, isolated=True)
    assert p.options["isolated"] is True
    w = p.spawn(py_worker_argv(), {"POOLIPC_TEST_MODE": "echo"})
    vals = [float(i) + 0.25 for i in range(256)]
    buf = p.alloc(4 * len(vals), dtype="float32", shape=[len(vals)])
    p.write(buf.ptr, struct.pack(f"<{len(vals)}f", *vals))
    (res,) = p.run(w, [poolipc.TensorRef(buf.ptr, "float32", [len(vals)])], read_only=True)
    assert p.last_input_rungs == ["arena copy"], p.last_input_rungs
    assert isinstance(res, poolipc.ArenaResult) and res.rung == "arena"
    got = p.read(res.ptr, 4 * len(vals))
    assert struct.unpack("<I", got[:4])[0] == 0xEC400000
    assert struct.unpack(f"<{len(vals) - 1}f", got[4:]) == tuple(vals[1:])
    del res
    assert p.stop(w) == 0


def test_one_worker_spawned_isolated_beside_a_trusted_one_takes_the_arena_copy(request):
    if not CHILD:
        return run_in_child_pytest(__file__, request, {"POOLIPC_ISOLATED_CHILD": "1"})
    p = poolipc.Parent(0)
    assert p.options["isolated"] is False
    isolated = p.spawn(py_worker_argv(), {"POOLIPC_TEST_MODE": "echo"}, isolated=True)
    trusted = p.spawn(py_worker_argv(), {"POOLIPC_TEST_MODE": "echo"})
    with pytest.raises(TypeError):
        p.spawn(py_worker_argv(), {"POOLIPC_TEST_MODE": "echo"}, isolated="yes")
    vals = [float(i) - 0.5 for i in range(256)]
    buf = p.alloc(4 * len(vals), dtype="float32", shape=[len(vals)])
    p.write(buf.ptr, struct.pack(f"<{len(vals)}f", *vals))
    t = poolipc.TensorRef(buf.ptr, "float32", [len(vals)])
    for w, rung in [(isolated, "arena copy"), (trusted, "pool pointer"), (isolated, "arena copy")]:
        (res,) = p.run(w, [t], read_only=True)
        assert p.last_input_rungs == [rung], (w, p.last_input_rungs)
        got = p.read(res.ptr, 4 * len(vals))
        assert struct.unpack("<I", got[:4])[0] == 0xEC400000
        assert struct.unpack(f"<{len(vals) - 1}f", got[4:]) == tuple(vals[1:])
        del res
    assert p.stop(isolated) == 0
    assert p.stop(trusted) == 0
