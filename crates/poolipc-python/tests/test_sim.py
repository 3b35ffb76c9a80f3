"""The binding on the simulated driver, across real processes: parent and worker, views,
lifetimes, errors, and the ComfyUI prestartup script run the way ComfyUI runs it.

Run: POOLIPC_DRIVER=sim python -m pytest crates/poolipc-python/tests (the module sets it too).
"""

import enum
import gc
import importlib.util
import itertools
import json
import os
import pathlib
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import types
import warnings

import pytest

os.environ.setdefault("POOLIPC_DRIVER", "sim")
if os.environ["POOLIPC_DRIVER"] != "sim":
    pytest.skip("test_sim.py runs on the simulated driver only", allow_module_level=True)
if "torch" in sys.modules:
    pytest.skip("torch is imported in this process (gpu_torch_test.py ran first?); run "
                "test_sim.py in its own pytest process", allow_module_level=True)

import poolipc  # noqa: E402

from conftest import REPO, poolipc_binary, py_worker_argv  # noqa: E402

# The ComfyUI pack: comfyui-poolipc/ (comfyui/ before it was renamed).
PRESTARTUP = next(
    (p for p in (REPO / "comfyui-poolipc" / "prestartup_script.py", REPO / "comfyui" / "prestartup_script.py")
     if p.exists()),
    REPO / "comfyui-poolipc" / "prestartup_script.py",
)


# The process's parent is made once, by the fixture's install_pool: a short stop deadline
# keeps the test of a worker that ignores Bye quick.
STOP_TIMEOUT = 2.0


def marker(i):
    return 0xEC400000 | i


@pytest.fixture(scope="module")
def parent():
    assert "torch" not in sys.modules, "the sim suite must not import torch"
    info = poolipc.install_pool(0, stop_timeout=STOP_TIMEOUT)
    assert info["installed"] and "SIMULATED" in info["driver"]
    return poolipc.Parent(0)


def wait_until(cond, timeout=30.0):
    """Polls `cond` until it is true or `timeout` passed; returns its last value. Only a
    failing test waits the whole time."""
    end = time.monotonic() + timeout
    while True:
        v = cond()
        if v or time.monotonic() > end:
            return v
        time.sleep(0.01)


def spawn(parent, mode="echo", extra=None):
    env = {"POOLIPC_TEST_MODE": mode}
    env.update(extra or {})
    return parent.spawn(py_worker_argv(), env)


def f32_buffer(parent, values):
    buf = parent.alloc(4 * len(values), dtype="float32", shape=[len(values)])
    parent.write(buf.ptr, struct.pack(f"<{len(values)}f", *values))
    return buf


# --- the parent and a Python worker -------------------------------------------------------


def test_a_python_worker_echoes_a_float32_tensor_through_the_binding(parent):
    w = spawn(parent)
    assert parent.canary_report(w) is not None
    vals = [float(i) + 0.5 for i in range(1000)]
    buf = f32_buffer(parent, vals)
    (res,) = parent.run(w, [poolipc.TensorRef(buf.ptr, "float32", [10, 100])])
    assert isinstance(res, poolipc.DeviceBuffer)
    assert res.dtype == "float32" and res.shape == (10, 100) and res.nbytes == 4000
    got = parent.read(res.ptr, 4000)
    assert struct.unpack("<I", got[:4])[0] == marker(0)
    assert struct.unpack("<999f", got[4:]) == tuple(vals[1:])
    assert parent.last_input_rungs == ["pool pointer"]
    assert parent.stop(w) == 0


def test_stats_has_every_counter_its_typed_dict_names_and_says_export_reuse_was_proven(parent):
    w = spawn(parent)
    buf = f32_buffer(parent, [1.0] * 4)
    parent.run(w, [poolipc.TensorRef(buf.ptr, "float32", [4])])
    stats = parent.stats()
    assert set(stats) == set(poolipc.ParentStats.__annotations__), set(stats) ^ set(
        poolipc.ParentStats.__annotations__
    )
    counters = {k: v for k, v in stats.items() if k != "export_reuse"}
    assert all(isinstance(v, int) and v >= 0 for v in counters.values()), counters
    assert stats["jobs_completed"] >= 1 and stats["pool_pointer_tensors"] >= 1
    # The job ended before run returned: no worker busy now, one at most so far.
    assert stats["workers_busy"] == 0 and stats["most_workers_busy"] >= 1, stats
    # The canary battery of the pool's first worker ran the check; the simulated driver
    # behaves as driver 580 does (an old blob reaches a new allocation of its size).
    assert stats["export_reuse"] == "proven", stats
    assert parent.stop(w) == 0


@pytest.mark.parametrize("mode", ["drop-unfinished", "any-thread"])
def test_a_worker_that_drops_its_jobs_or_takes_them_on_any_thread_serves_them_all(parent, mode):
    # A worker's calls run on the thread that makes them; what a drop posts runs before the
    # next call waits (else the next job never comes: the parent waits for this one's DONE).
    w = spawn(parent, mode)
    for k in range(5):
        vals = [float(i + k) for i in range(16)]
        buf = f32_buffer(parent, vals)
        (res,) = parent.run(w, [poolipc.TensorRef(buf.ptr, "float32", [16])])
        got = parent.read(res.ptr, 64)
        assert struct.unpack("<I", got[:4])[0] == marker(0)
        assert list(struct.unpack("<15f", got[4:])) == vals[1:]
    assert parent.stop(w) == 0


@pytest.mark.parametrize(
    "dtype,elem,count",
    [("float32", 4, 7), ("bfloat16", 2, 1001), ("int64", 8, 13), ("uint8", 1, 4099)],
)
def test_dtypes_and_odd_sizes_round_trip(parent, dtype, elem, count):
    w = spawn(parent)
    n = elem * count
    buf = parent.alloc(n, dtype=dtype)
    data = bytes((i * 7 + 3) % 251 for i in range(n))
    parent.write(buf.ptr, data)
    (res,) = parent.run(w, [poolipc.TensorRef(buf.ptr, dtype, [count])])
    assert res.dtype == dtype and res.nbytes == n
    got = parent.read(res.ptr, n)
    assert got[4:] == data[4:] and struct.unpack("<I", got[:4])[0] == marker(0)
    parent.stop(w)


def test_views_with_offsets_and_strides_arrive_as_described(parent, report):
    w = spawn(parent, "probe", report.env)
    base = f32_buffer(parent, [float(i) for i in range(64)])  # an 8x8 matrix
    # rows 2..5, columns 1..3 of the matrix: offset 2*8+1 elements, strides (8, 1)
    sub = poolipc.TensorRef(base.ptr + 4 * 17, "float32", [4, 3], [8, 1])
    # its transpose: strides (1, 8)
    tr = poolipc.TensorRef(base.ptr + 4 * 17, "float32", [3, 4], [1, 8])
    out = parent.run(w, [sub, tr])
    want_sub = [float(8 * r + c) for r in range(2, 6) for c in range(1, 4)]
    want_tr = [float(8 * r + c) for c in range(1, 4) for r in range(2, 6)]
    for res, want, i in ((out[0], want_sub, 0), (out[1], want_tr, 1)):
        got = parent.read(res.ptr, 48)
        assert struct.unpack("<I", got[:4])[0] == marker(i)
        assert list(struct.unpack("<11f", got[4:])) == want[1:]
    parent.stop(w)  # the worker writes its report after the job ended
    (rep,) = [x for x in report.lines() if "inputs" in x]
    a, b = rep["inputs"]
    assert a["shape"] == [4, 3] and a["strides"] == [8, 1] and a["nbytes"] == 4 * (3 * 8 + 2 + 1)
    assert b["shape"] == [3, 4] and b["strides"] == [1, 8]
    # both views point into the same import, 17 elements in
    assert a["ptr"] == b["ptr"]
    assert a["cai"]["strides"] == [32, 4] and a["cai"]["typestr"] == "<f4"
    assert a["capsule"]["strides"] == [8, 1] and a["capsule"]["data"] == a["ptr"]


def test_a_view_like_object_with_data_ptr_and_a_dtype_value_is_lent_as_described(parent, report):
    class ViewLike:
        def __init__(self, ptr):
            self._ptr = ptr
            self.dtype = poolipc.DType.float32
            self.shape = (3, 4)
            self.strides = (1, 8)

        def data_ptr(self):
            return self._ptr

    w = spawn(parent, "probe", report.env)
    base = f32_buffer(parent, [float(i) for i in range(64)])
    out = parent.run(w, [ViewLike(base.ptr + 4 * 17)])
    assert parent.read(out[0].ptr, 48)[4:8] == struct.pack("<f", float(8 * 3 + 1))
    parent.stop(w)
    (rep,) = [x for x in report.lines() if "inputs" in x]
    (a,) = rep["inputs"]
    assert a["shape"] == [3, 4] and a["strides"] == [1, 8] and a["dtype"] == "float32"


def test_an_object_that_is_no_tensor_is_a_type_error_naming_its_type(parent):
    with pytest.raises(TypeError, match="cannot lend int: give a torch tensor or a TensorRef"):
        parent.run(1, [3])
    with pytest.raises(TypeError, match="cannot lend SimpleNamespace"):
        parent.run(1, [types.SimpleNamespace(ptr=None, dtype="float32", shape=[4])])


def test_strides_that_do_not_match_the_shape_are_refused_with_the_input_named(parent):
    ok = poolipc.TensorRef(0x1000, "float32", [4])
    with pytest.raises(ValueError, match="input 1: 1 strides for 2 dimensions"):
        parent.run(1, [ok, poolipc.TensorRef(0x1000, "float32", [4, 3], [1])])


def test_a_torch_tensor_is_read_by_data_ptr_stride_and_is_cuda():
    # A stand-in torch (the suite runs without torch), in a child interpreter so that this one
    # never sees a module named torch: the binding reads tensors by isinstance(torch.Tensor).
    script = textwrap.dedent("""
        import sys, types
        torch = types.ModuleType("torch")
        class Tensor:
            def __init__(self, is_cuda, dtype):
                self.is_cuda, self.dtype, self.shape = is_cuda, dtype, (2, 3)
                self.device = "cuda:0" if is_cuda else "cpu"
            def data_ptr(self):
                return 0x2000
            def stride(self):
                return (3, -1)
        torch.Tensor = Tensor
        sys.modules["torch"] = torch
        from poolipc import _native
        p = _native.NativeParent(0)
        for t in (Tensor(False, "torch.float32"), Tensor(True, "torch.float33"), Tensor(True, "torch.float32")):
            try:
                p.submit(999, [t])
            except Exception as e:
                print(type(e).__name__, e)
    """)
    env = dict(os.environ, POOLIPC_DRIVER="sim")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert len(lines) == 3, out.stdout + out.stderr
    assert lines[0] == "ValueError poolipc: a cpu tensor cannot be lent; lend CUDA tensors"
    assert lines[1].startswith('ValueError poolipc: input 0: unknown dtype "float33"')
    # read with stride(): its negative stride is what refuses it
    assert lines[2].startswith("ValueError poolipc: input 0: negative strides are not supported"), lines[2]


def test_a_negative_stride_is_refused_before_anything_is_lent(parent):
    w = spawn(parent)
    buf = f32_buffer(parent, [1.0] * 8)
    with pytest.raises(ValueError, match="input 0: negative strides"):
        parent.run(w, [poolipc.TensorRef(buf.ptr + 28, "float32", [8], [-1])])
    # the worker is untouched and serves the next job
    (res,) = parent.run(w, [poolipc.TensorRef(buf.ptr, "float32", [8])])
    assert res.nbytes == 32
    parent.stop(w)


def test_a_bad_dtype_is_a_clear_error_on_both_sides(parent, report):
    with pytest.raises(ValueError, match=r"unknown dtype .float33.*float32"):
        parent.run(1, [poolipc.TensorRef(0x1000, "float33", [4])])
    w = spawn(parent, "bad-dtype", report.env)
    buf = f32_buffer(parent, [1.0] * 4)
    with pytest.raises(poolipc.JobFailedError, match="unknown dtype .float33."):
        parent.run(w, [poolipc.TensorRef(buf.ptr, "float32", [4])])
    parent.stop(w)


def test_a_tensor_outside_its_allocation_is_refused_and_the_worker_serves_the_next_job(parent):
    w = spawn(parent)
    buf = f32_buffer(parent, [1.0] * 4)
    good = f32_buffer(parent, [4.5] * 8)
    with pytest.raises(ValueError, match="input 1 .*past its allocation") as e:
        parent.run(w, [poolipc.TensorRef(good.ptr, "float32", [8]),
                       poolipc.TensorRef(buf.ptr, "float32", [400])])
    assert not isinstance(e.value, poolipc.PoolipcError)  # a plain ValueError
    # nothing of the refused job reached the worker: it serves the next one
    (res,) = parent.run(w, [poolipc.TensorRef(good.ptr, "float32", [8])])
    assert parent.read(res.ptr + 4, 4) == struct.pack("<f", 4.5)
    assert parent.stop(w) == 0


# --- DLPack, __cuda_array_interface__, lifetimes -----------------------------------------


def test_views_describe_themselves_by_dlpack_and_cuda_array_interface(parent, report):
    w = spawn(parent, "probe", report.env)
    f = f32_buffer(parent, [1.0] * 6)
    h = parent.alloc(2 * 5, dtype="bfloat16")
    parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [2, 3]), poolipc.TensorRef(h.ptr, "bfloat16", [5])])
    parent.stop(w)  # the worker writes its report after the job ended
    (rep,) = [x for x in report.lines() if "inputs" in x]
    a, b = rep["inputs"]
    assert a["dlpack_device"] == [2, 0]  # kDLCUDA, device 0
    assert a["cai"] == {
        "shape": [2, 3], "typestr": "<f4", "data": [a["ptr"], False], "strides": [12, 4],
        "version": 3, "stream": rep["job_stream"] or None,
    }
    cap = a["capsule"]
    assert cap["name"] == "dltensor" and cap["device"] == [2, 0] and cap["ndim"] == 2
    assert cap["dtype"] == [2, 32, 1] and cap["shape"] == [2, 3] and cap["strides"] == [3, 1]
    assert cap["data"] == a["ptr"] and cap["byte_offset"] == 0
    v = a["capsule_versioned"]
    assert v["name"] == "dltensor_versioned" and v["version"] == [1, 0] and v["shape"] == [2, 3]
    # bfloat16: DLPack code kDLBfloat, no __cuda_array_interface__ (numpy has no type string)
    assert b["capsule"]["dtype"] == [4, 16, 1]
    assert "no __cuda_array_interface__" in b["cai_error"]
    assert a["repr"].startswith("InputView(")
    assert rep["results"][0]["is_result"] and rep["results"][0]["cai_strides"] == [12, 4]


def test_capsules_count_as_live_until_their_deleter_runs(parent, report):
    w = spawn(parent, "probe", report.env)
    f = f32_buffer(parent, [1.0] * 4)
    parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [4])])
    parent.stop(w)  # the worker writes its report after the job ended
    (rep,) = [x for x in report.lines() if "inputs" in x]
    (a,) = rep["inputs"]
    assert a["live_with_capsule"] == 1
    assert a["live_after_drop"] == 0  # an unconsumed capsule's destructor deletes it
    assert a["live_consumed"] == 2  # renamed capsules belong to the consumer
    assert rep["after"]["live_exports_before_deleters"] == 2
    assert rep["after"]["live_exports_after_deleters"] == 0


def test_a_view_used_after_its_job_ended_raises(parent, report):
    w = spawn(parent, "probe", report.env)
    f = f32_buffer(parent, [1.0] * 4)
    parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [4])])
    parent.stop(w)  # the worker writes its report after the job ended
    (rep,) = [x for x in report.lines() if "inputs" in x]
    after = rep["after"]
    for key in ("ptr", "read_bytes", "dlpack", "result_ptr", "finish_again", "request_again"):
        assert after[key] is not None and after[key].startswith("ExpiredViewError"), (key, after[key])
    assert "belongs to the parent again" in after["ptr"]
    assert after["cai"].startswith("AttributeError")  # so hasattr() says no
    assert after["valid"] is False and after["open"] is False


# --- failures -------------------------------------------------------------------------------


def test_an_exception_in_the_worker_fails_the_job_with_its_text(parent):
    w = spawn(parent, "fail")
    f = f32_buffer(parent, [1.0] * 4)
    with pytest.raises(poolipc.WorkerError, match="ValueError: the worker failed on purpose") as e:
        parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [4])])
    # a JobFailedError too, naming the worker and carrying its words
    assert isinstance(e.value, poolipc.JobFailedError)
    assert e.value.worker == w and "failed on purpose" in e.value.message
    # the worker lives on and serves the next job (it fails that one too, on purpose)
    assert parent.pid(w) is not None
    with pytest.raises(poolipc.WorkerError):
        parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [4])])
    assert parent.stop(w) == 0


def test_a_workers_error_text_is_marked_as_its_own_and_stripped_of_control_characters(parent):
    w = spawn(parent, "fail-escape")
    f = f32_buffer(parent, [1.0] * 4)
    with pytest.raises(poolipc.WorkerError) as e:
        parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [4])])
    for text in (str(e.value), e.value.message):
        assert text.startswith("worker says: ") or "worker says: " in text, text
        assert not any(c in text for c in "\x1b\x07\r"), repr(text)
        # a line break stays, indented: the worker cannot forge a line of the parent's log
        assert "\n    ERROR poolipc: forged" in text and "\nERROR" not in text, repr(text)
    assert parent.pid(w) is not None
    assert parent.stop(w) == 0


def test_a_job_too_large_to_lend_is_a_value_error_at_submit_and_the_worker_takes_the_next(parent):
    w = spawn(parent)
    f = f32_buffer(parent, [1.0] * 4)
    with pytest.raises(ValueError, match="cannot be lent in one message"):
        parent.submit(w, [poolipc.TensorRef(f.ptr, "float32", [4])] * 7000)
    with pytest.raises(ValueError, match="shape.*at most 32"):
        parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [1] * 33)])
    with pytest.raises(ValueError, match="above i64::MAX"):
        parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [2**63, 0])])
    (res,) = parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [4])])
    assert struct.unpack("<I", parent.read(res.ptr, 4))[0] == marker(0)
    assert parent.stop(w) == 0


def test_a_result_request_too_large_to_grant_is_refused_and_the_worker_goes_on(parent, report):
    w = spawn(parent, "too-many-results", report.env)
    f = f32_buffer(parent, [1.0] * 4)
    with pytest.raises(poolipc.WorkerError, match="at most 4096"):
        parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [4])])
    (rep,) = [x["too_many"] for x in report.lines() if "too_many" in x]
    assert "at most 4096" in rep, rep
    assert parent.pid(w) is not None
    assert parent.stop(w) == 0


def _worker_environ(parent, report, **allow):
    w = parent.spawn(py_worker_argv(), {"POOLIPC_TEST_MODE": "environ", **report.env}, **allow)
    f = f32_buffer(parent, [1.0] * 4)
    parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [4])])
    assert parent.stop(w) == 0
    (names,) = [line["environ"] for line in report.lines() if "environ" in line]
    return set(names)


def test_a_variable_not_on_the_env_allowlist_does_not_reach_the_worker(parent, report, monkeypatch):
    monkeypatch.setenv("POOLIPC_TEST_ALLOWED", "1")  # POOLIPC_* is always kept
    monkeypatch.setenv("FAKE_API_KEY_FOR_TEST", "sk-secret")
    monkeypatch.setenv("HF_HOME_FOR_TEST", "/data/hf")
    got = _worker_environ(parent, report, env_allowlist=["HF_HOME_FOR_TEST"])
    assert "FAKE_API_KEY_FOR_TEST" not in got
    assert {"HF_HOME_FOR_TEST", "POOLIPC_TEST_ALLOWED", "POOLIPC_TEST_MODE", "PATH"} <= got


def test_without_an_env_allowlist_the_worker_inherits_the_whole_environment(parent, report, monkeypatch):
    monkeypatch.setenv("FAKE_API_KEY_FOR_TEST", "sk-secret")
    assert "FAKE_API_KEY_FOR_TEST" in _worker_environ(parent, report)


def test_an_env_allowlist_given_as_a_string_is_a_type_error(parent):
    with pytest.raises(TypeError, match="env_allowlist"):
        parent.spawn(py_worker_argv(), env_allowlist="PATH")


@pytest.mark.parametrize("mode", ["die-after-import", "die-after-grant"])
def test_a_worker_killed_mid_job_fails_that_job_only(parent, mode):
    dying = spawn(parent, mode)
    healthy = spawn(parent)
    f = f32_buffer(parent, [2.0] * 16)
    before = poolipc.memory_stats()["used_current"]
    with pytest.raises(poolipc.JobFailedError, match="job failed"):
        parent.run(dying, [poolipc.TensorRef(f.ptr, "float32", [16])])
    # what the dead worker held is released: only the input is still in use
    assert poolipc.memory_stats()["used_current"] == before
    (res,) = parent.run(healthy, [poolipc.TensorRef(f.ptr, "float32", [16])])
    assert parent.read(res.ptr + 4, 4) == struct.pack("<f", 2.0)
    with pytest.raises(poolipc.UnknownWorkerError):
        parent.run(dying, [poolipc.TensorRef(f.ptr, "float32", [16])])
    parent.stop(healthy)


def test_a_worker_on_the_parents_device_finds_it_by_uuid(parent):
    # POOLIPC_DEVICE=parent: the worker takes whichever of its devices has the parent's UUID.
    w = spawn(parent, extra={"POOLIPC_DEVICE": "parent"})
    buf = f32_buffer(parent, [1.5] * 8)
    (res,) = parent.run(w, [poolipc.TensorRef(buf.ptr, "float32", [8])])
    assert parent.read(res.ptr + 4, 4) == struct.pack("<f", 1.5)
    assert parent.stop(w) == 0


def test_a_worker_told_any_device_works_on_it(parent):
    # One simulated device here: "any:0" is the pool's own device, so pool pointers.
    w = spawn(parent, extra={"POOLIPC_DEVICE": "any:0"})
    buf = f32_buffer(parent, [3.5] * 8)
    (res,) = parent.run(w, [poolipc.TensorRef(buf.ptr, "float32", [8])])
    assert parent.read(res.ptr + 4, 4) == struct.pack("<f", 3.5)
    assert parent.last_input_rungs == ["pool pointer"]
    assert parent.stop(w) == 0


@pytest.mark.parametrize("device", ["gpu0", "any:", "any:x", "-", "-1", "any:-1"])
def test_a_worker_device_that_is_no_ordinal_parent_or_any_is_a_clear_error(device):
    with pytest.raises(ValueError, match="not an ordinal, 'parent' or 'any:N'"):
        poolipc.Worker(device)


def test_a_worker_that_sees_no_device_of_the_parents_is_refused_with_a_reason(parent):
    with pytest.raises(poolipc.PoolipcError, match="sees no device"):
        spawn(parent, extra={"POOLIPC_DEVICE": "parent", "POOLIPC_SIM_VISIBLE_DEVICES": ""})
    # the parent goes on
    w = spawn(parent)
    buf = f32_buffer(parent, [2.5] * 8)
    (res,) = parent.run(w, [poolipc.TensorRef(buf.ptr, "float32", [8])])
    assert parent.read(res.ptr + 4, 4) == struct.pack("<f", 2.5)
    assert parent.stop(w) == 0


def test_results_from_a_caller_allocator_are_what_run_returns(parent):
    w = spawn(parent)
    f = f32_buffer(parent, [3.0] * 8)
    made = []
    threads = []

    def alloc(dtype, shape, nbytes):
        # Called on the parent's allocator thread, which took the GIL while run() waits
        # without it.
        threads.append(threading.get_ident())
        b = parent.alloc(nbytes, dtype=dtype, shape=shape)
        made.append((dtype, shape, nbytes))
        return b

    (res,) = parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [2, 4])], alloc=alloc)
    assert made == [("float32", (2, 4), 32)]
    assert threads and threads[0] != threading.get_ident()
    assert isinstance(res, poolipc.DeviceBuffer) and res.shape == (2, 4)
    assert parent.read(res.ptr + 4, 4) == struct.pack("<f", 3.0)
    parent.stop(w)


def test_an_allocator_that_waits_holds_up_only_its_own_job(parent):
    # The allocator of one job waits until another worker's job has run to its end: it runs
    # off the IO thread, so that job is served meanwhile (on the IO thread, both would wait
    # for the timeout), and the waiting job still gets what its allocator made.
    slow_w, other_w = spawn(parent), spawn(parent)
    f = f32_buffer(parent, [5.0] * 8)
    entered, other_done = threading.Event(), threading.Event()

    def alloc(dtype, shape, nbytes):
        entered.set()
        other_done.wait(timeout=10)
        return parent.alloc(nbytes, dtype=dtype, shape=shape)

    slow = parent.submit(slow_w, [poolipc.TensorRef(f.ptr, "float32", [8])], alloc=alloc)
    assert entered.wait(timeout=30)
    t0 = time.monotonic()
    (res_other,) = parent.run(other_w, [poolipc.TensorRef(f.ptr, "float32", [8])])
    other_took = time.monotonic() - t0
    other_done.set()
    (res_slow,) = slow.wait(timeout=30)
    assert other_took < 5, f"the other worker's job took {other_took:.1f} s while an allocator waited"
    assert parent.read(res_other.ptr + 4, 4) == struct.pack("<f", 5.0)
    assert parent.read(res_slow.ptr + 4, 4) == struct.pack("<f", 5.0)
    parent.stop(slow_w)
    parent.stop(other_w)


def test_an_allocator_that_raises_fails_the_job_with_its_error(parent):
    w = spawn(parent)
    f = f32_buffer(parent, [3.0] * 8)

    def alloc(dtype, shape, nbytes):
        raise MemoryError("no room for the result")

    with pytest.raises(poolipc.JobFailedError, match="no room for the result") as e:
        parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [8])], alloc=alloc)
    assert isinstance(e.value.__cause__, MemoryError) and e.value.worker == w
    # the worker is untouched
    (res,) = parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [8])])
    assert res.nbytes == 32
    parent.stop(w)


def test_memory_stats_are_the_pools_figures(parent):
    s0 = poolipc.memory_stats()
    b = parent.alloc(3 << 20)
    s1 = poolipc.memory_stats()
    assert s1["used_current"] >= s0["used_current"] + (3 << 20)
    assert s1["used_high"] >= s1["used_current"] and s1["reserved_current"] >= s1["used_current"]
    b.free()
    parent.synchronize()
    assert poolipc.memory_stats()["used_current"] == s0["used_current"]
    with pytest.raises(poolipc.PoolipcError, match="freed"):
        b.ptr


def test_a_rust_worker_serves_a_python_parent(parent):
    exe = poolipc_binary()
    if exe is None:
        pytest.skip("no poolipc binary (cargo build -p poolipc-cli, or set POOLIPC_BIN)")
    w = parent.spawn([exe, "__demo-worker"])
    f = f32_buffer(parent, [5.0] * 33)
    (res,) = parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [3, 11])])
    got = parent.read(res.ptr, 132)
    assert struct.unpack("<I", got[:4])[0] == marker(0) and got[4:8] == struct.pack("<f", 5.0)
    assert parent.stop(w) == 0


# --- one Parent, many threads; deadlines; typed errors ------------------------------------


def gate_env(report, tmp_path):
    gate = tmp_path / "gate"
    return gate, {**report.env, "POOLIPC_TEST_GATE": str(gate)}


def entered(report):
    """The pids of gate workers that hold a job (and wait on the gate)."""
    return {x["entered"] for x in report.lines() if "entered" in x}


def test_two_threads_sharing_one_parent_run_jobs_on_two_workers_at_once(parent, report, tmp_path):
    gate, env = gate_env(report, tmp_path)
    a, b = spawn(parent, "gate", env), spawn(parent, "gate", env)
    pids = {parent.pid(a), parent.pid(b)}
    fa, fb = f32_buffer(parent, [1.25] * 8), f32_buffer(parent, [2.75] * 8)
    out, errors, alloc_threads = {}, {}, []

    def alloc(dtype, shape, nbytes):
        alloc_threads.append(threading.get_ident())
        return parent.alloc(nbytes, dtype=dtype, shape=shape)

    def job(w, buf, with_alloc):
        try:
            out[w] = parent.run(w, [poolipc.TensorRef(buf.ptr, "float32", [8])],
                                alloc=alloc if with_alloc else None)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[w] = e

    threads = [threading.Thread(target=job, args=(a, fa, True)),
               threading.Thread(target=job, args=(b, fb, False))]
    for t in threads:
        t.start()
    try:
        # Both workers hold a job at once: each says so before it waits on the gate, and
        # neither job can end before the gate opens. Jobs run one at a time would never get
        # here (the second would not start while the first waits).
        assert wait_until(lambda: entered(report) == pids), (report.lines(), errors)
        assert all(t.is_alive() for t in threads) and not errors
        # The parent answers while both jobs run.
        assert {parent.pid(a), parent.pid(b)} == pids
        assert parent.canary_report(a) is not None
        assert set(parent.workers()) >= {a, b}
        assert parent.stats()["jobs_submitted"] >= 2
    finally:
        gate.touch()
        for t in threads:
            t.join(30)
    assert not errors, errors
    for w, val in ((a, 1.25), (b, 2.75)):
        (res,) = out[w]
        assert parent.read(res.ptr + 4, 4) == struct.pack("<f", val)
    assert alloc_threads and threading.get_ident() not in alloc_threads
    assert parent.stop(a) == 0 and parent.stop(b) == 0


def test_submit_gives_a_handle_whose_wait_releases_the_gil(parent, report, tmp_path):
    gate, env = gate_env(report, tmp_path)
    w = spawn(parent, "gate", env)
    f = f32_buffer(parent, [6.5] * 8)
    h = parent.submit(w, [poolipc.TensorRef(f.ptr, "float32", [8])])
    assert h.worker == w and isinstance(h.id, int)
    assert wait_until(lambda: entered(report) == {parent.pid(w)})
    # A Python thread counts while this one waits: only a wait without the GIL lets it.
    counting, count = [True], [0]

    def counter():
        while counting[0]:
            count[0] += 1

    t = threading.Thread(target=counter)
    t.start()
    try:
        before = count[0]
        with pytest.raises(TimeoutError, match="still running"):
            h.wait(timeout=0.3)
        assert count[0] > before
    finally:
        counting[0] = False
        t.join()
    assert not h.done and h.input_rungs is None
    gate.touch()
    (res,) = h.wait(timeout=30)
    assert h.done and h.input_rungs == ["pool pointer"] and h.result_rungs == ["pool pointer"]
    assert parent.read(res.ptr + 4, 4) == struct.pack("<f", 6.5)
    (again,) = h.wait()
    assert again is res  # the same results, not a second copy
    assert parent.stop(w) == 0


def test_wait_any_gives_the_job_that_ended_and_times_out_when_none_did(parent, report, tmp_path):
    gate, env = gate_env(report, tmp_path)
    held = spawn(parent, "gate", env)
    free = spawn(parent, "echo")
    f = f32_buffer(parent, [2.5] * 8)
    ref = poolipc.TensorRef(f.ptr, "float32", [8])
    a = parent.submit(held, [ref])
    assert wait_until(lambda: entered(report) == {parent.pid(held)})
    b = parent.submit(free, [ref])
    # The free worker's job ends; the held one cannot until its gate opens.
    assert poolipc.wait_any([a, b], timeout=30) == 1
    (res,) = b.wait(timeout=0)
    assert parent.read(res.ptr + 4, 4) == struct.pack("<f", 2.5)
    # A job already waited for counts as ended.
    assert poolipc.wait_any([b, a]) == 0
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="none of the 1 jobs has ended"):
        poolipc.wait_any([a], timeout=0.2)
    assert time.monotonic() - start >= 0.2
    with pytest.raises(ValueError, match="at least one job handle"):
        poolipc.wait_any([])
    with pytest.raises(ValueError, match="timeout=-1"):
        poolipc.wait_any([a], timeout=-1)
    with pytest.raises(TypeError, match=r"handles\[1\] has type int"):
        poolipc.wait_any([a, 7])
    gate.touch()
    assert poolipc.wait_any([a], timeout=30) == 0
    a.wait(timeout=0)
    # A handle whose answer was taken counts as ended, at once.
    assert poolipc.wait_any([a], timeout=0) == 0
    assert parent.stop(held) == 0 and parent.stop(free) == 0


def test_run_waits_for_its_job_in_the_same_release_of_the_gil_that_submits_it(
        parent, report, tmp_path):
    # `run`'s submit waits once (50 ms at most) before it takes the GIL back: a job that
    # ends by then comes back with the handle, answered (one GIL hand-back, not two).
    w = spawn(parent)
    f = f32_buffer(parent, [3.5] * 8)
    ref = poolipc.TensorRef(f.ptr, "float32", [8])
    answered = []
    for _ in range(5):  # one at least within 50 ms, on a busy machine too
        native, _, _ = parent._submit(w, [ref], None, None, None, False, True)
        answered.append(native.done)
        out, rungs = native.wait(None)
        assert list(rungs) == ["pool pointer"]
        assert parent.read(out[0][0] + 4, 4) == struct.pack("<f", 3.5)
    assert any(answered), answered
    # A job longer than that first wait is waited for as before.
    gate, env = gate_env(report, tmp_path)
    g = spawn(parent, "gate", env)
    native, _, _ = parent._submit(g, [ref], None, None, None, False, True)
    assert not native.done
    gate.touch()
    out, rungs = native.wait(30)
    assert list(rungs) == ["pool pointer"]
    # A worker's error comes from the wait, not from the submit.
    bad = spawn(parent, "fail")
    native, _, _ = parent._submit(bad, [ref], None, None, None, False, True)
    with pytest.raises(poolipc.WorkerError):
        native.wait(None)
    with pytest.raises(poolipc.WorkerError):
        parent.run(bad, [ref])
    for x in (w, g, bad):
        parent.stop(x)


def test_a_worker_killed_mid_job_raises_job_failed_error_and_the_next_spawn_works(
        parent, report, tmp_path):
    gate, env = gate_env(report, tmp_path)
    w = spawn(parent, "gate", env)
    pid = parent.pid(w)
    lost = parent.stats()["workers_lost"]
    f = f32_buffer(parent, [1.0] * 8)
    h = parent.submit(w, [poolipc.TensorRef(f.ptr, "float32", [8])])
    assert wait_until(lambda: entered(report) == {pid})
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(poolipc.JobFailedError, match="job failed") as e:
        h.wait(timeout=30)
    assert type(e.value) is poolipc.JobFailedError  # the worker was lost: no WorkerError
    assert e.value.worker == w and e.value.reason in ("hung_up", "reaped", "deadline_expired")
    assert e.value.detail
    assert parent.stats()["workers_lost"] == lost + 1
    assert parent.pid(w) is None and w not in parent.workers()
    with pytest.raises(poolipc.UnknownWorkerError) as unknown:
        parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [8])])
    assert isinstance(unknown.value, KeyError) and unknown.value.worker == w
    # the next spawn works, and so does its job
    n = spawn(parent)
    (res,) = parent.run(n, [poolipc.TensorRef(f.ptr, "float32", [8])])
    assert parent.read(res.ptr + 4, 4) == struct.pack("<f", 1.0)
    assert parent.stop(n) == 0


def test_stop_kills_a_worker_that_ignores_bye_within_stop_timeout(parent, report):
    w = spawn(parent, "linger", report.env)
    f = f32_buffer(parent, [2.0] * 8)
    parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [8])])
    pid = parent.pid(w)
    t0 = time.monotonic()
    code = parent.stop(w)
    took = time.monotonic() - t0
    # It heard the goodbye and stayed; stop waited its deadline, no more (with a margin).
    assert wait_until(lambda: any(x.get("lingering") == pid for x in report.lines()), 5)
    assert STOP_TIMEOUT - 0.5 <= took < STOP_TIMEOUT + 3.0, took
    assert code is None  # killed, not exited
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped
    with pytest.raises(poolipc.UnknownWorkerError):
        parent.stop(w)


def test_stop_of_one_worker_does_not_wait_for_another_workers_job(parent, report, tmp_path):
    gate, env = gate_env(report, tmp_path)
    busy = spawn(parent, "gate", env)
    idle = spawn(parent)
    f = f32_buffer(parent, [3.0] * 8)
    h = parent.submit(busy, [poolipc.TensorRef(f.ptr, "float32", [8])])
    assert wait_until(lambda: entered(report) == {parent.pid(busy)})
    assert parent.stop(idle) == 0  # while busy's job waits on the gate
    assert not h.done
    gate.touch()
    (res,) = h.wait(timeout=30)
    assert parent.read(res.ptr + 4, 4) == struct.pack("<f", 3.0)
    assert parent.stop(busy) == 0


def test_an_unknown_worker_is_an_unknown_worker_error(parent):
    f = f32_buffer(parent, [1.0] * 4)
    for call in (lambda: parent.run(99999, [poolipc.TensorRef(f.ptr, "float32", [4])]),
                 lambda: parent.stop(99999)):
        with pytest.raises(poolipc.UnknownWorkerError, match="unknown worker") as e:
            call()
        assert isinstance(e.value, KeyError) and isinstance(e.value, poolipc.PoolipcError)
    assert parent.pid(99999) is None


def test_a_cancel_the_worker_ignores_ends_the_job_within_the_grace_and_a_second(parent, report, tmp_path):
    # A worker that holds its job behind a shut gate and does not answer `cancel()` is killed
    # at the parent's `cancel_grace`: the job raises JobFailedError("cancelled") within the
    # grace and a second, the worker is gone, and the pool's memory is back.
    grace = parent.options["cancel_grace"]
    assert grace == 3.0
    gate, env = gate_env(report, tmp_path)
    buf = f32_buffer(parent, [1.5] * 64)
    gc.collect()
    parent.synchronize()
    baseline = poolipc.memory_stats()["used_current"]
    w = spawn(parent, "gate", env)
    h = parent.submit(w, [poolipc.TensorRef(buf.ptr, "float32", [64])])
    assert wait_until(lambda: entered(report) == {parent.pid(w)})
    h.cancel()
    t = time.monotonic()
    with pytest.raises(poolipc.JobFailedError) as e:
        h.wait(timeout=grace + 10)
    took = time.monotonic() - t
    assert e.value.reason == "cancelled", e.value
    assert took <= grace + 1.0, took
    assert wait_until(lambda: w not in parent.workers(), 5)
    del h, e
    gc.collect()
    parent.synchronize()
    assert wait_until(lambda: poolipc.memory_stats()["used_current"] == baseline, 5)


def test_chaos_workers_raise_only_typed_errors_and_spare_an_honest_one(parent):
    # Rogues walking at random over the worker's side of the protocol (the test crate's
    # `poolipc-test-rogue chaos`), one after another, each given jobs, beside an honest
    # worker served from another thread: every rogue job ends with its result or a poolipc
    # exception (never a hang, never an untyped error), every honest answer is right, and
    # the pool's memory is back after.
    import random

    from conftest import rogue_binary

    rogue = rogue_binary()
    if rogue is None:
        pytest.skip("no poolipc-test-rogue built (cargo build -p poolipc-tests, or set POOLIPC_TEST_ROGUE_BIN)")
    buf = f32_buffer(parent, [1.5] * 64)
    gc.collect()
    parent.synchronize()
    baseline = poolipc.memory_stats()["used_current"]
    honest = spawn(parent)
    stop, wrong, honest_errors, honest_done = threading.Event(), [], [], [0]

    def serve_honestly():
        while not stop.is_set():
            try:
                (res,) = parent.run(honest, [poolipc.TensorRef(buf.ptr, "float32", [64])])
                if parent.read(res.ptr + 4, 4) != struct.pack("<f", 1.5):
                    wrong.append(parent.read(res.ptr, 8))
                del res
                honest_done[0] += 1
            except BaseException as e:  # noqa: BLE001 - the test reports them
                honest_errors.append(repr(e))
                return

    t = threading.Thread(target=serve_honestly)
    t.start()
    outcomes, untyped = {}, []

    def count(what):
        outcomes[what] = outcomes.get(what, 0) + 1

    try:
        for seed in range(1, 13):
            rng = random.Random(seed)
            try:
                w = parent.spawn([rogue], {"POOLIPC_TEST_ROGUE": "chaos", "POOLIPC_TEST_ROGUE_SEED": str(seed)})
            except poolipc.PoolipcError as e:
                count("spawn refused: " + type(e).__name__)
                continue
            for _ in range(5):
                handles = []
                for _ in range(rng.randint(1, 3)):
                    n = rng.randint(1, 4096)
                    b = parent.alloc(4 * n, dtype="float32", shape=[n])
                    try:
                        handles.append((parent.submit(w, [b], read_only=rng.random() < 0.3), b))
                    except poolipc.PoolipcError as e:
                        count("submit refused: " + type(e).__name__)
                for h, _b in handles:
                    try:
                        h.wait(timeout=60)
                        count("succeeded")
                    except TimeoutError:
                        pytest.fail(f"a job of chaos seed {seed} did not end within a minute")
                    except poolipc.PoolipcError as e:
                        count(type(e).__name__)
                    except BaseException as e:  # noqa: BLE001 - the test reports them
                        untyped.append((seed, repr(e)))
                if w not in parent.workers():
                    break
            try:
                parent.stop(w)
            except poolipc.UnknownWorkerError:
                pass  # condemned and reaped already
    finally:
        stop.set()
        t.join(60)
    print(f"rogue jobs: {outcomes}; honest jobs: {honest_done[0]}")
    # The last round's handles keep their results (waiting again gives the same) and inputs.
    handles = h = _b = b = None  # noqa: F841
    assert not untyped, untyped
    assert not honest_errors and not wrong, (honest_errors, wrong)
    assert honest_done[0] > 0
    parent.stop(honest)
    gc.collect()
    parent.synchronize()
    assert wait_until(lambda: poolipc.memory_stats()["used_current"] == baseline, 10), (
        poolipc.memory_stats()["used_current"],
        baseline,
    )


def test_four_threads_share_one_parent_through_random_kills_with_typed_errors_only(parent):
    import random

    rng = random.Random(11)
    threads_n, jobs_n = 4, 60
    bufs = [f32_buffer(parent, [float(t) + 0.5] * 64) for t in range(threads_n)]
    # Buffers of earlier tests that only a cycle collection frees (held by tracebacks) must go
    # before the baseline, or one freed mid-test leaves the pool below it.
    gc.collect()
    parent.synchronize()
    baseline = poolipc.memory_stats()["used_current"]
    workers = [spawn(parent) for _ in range(threads_n)]
    wrong, untyped, typed, done = [], [], [], [0]
    lock = threading.Lock()

    def body(t):
        w = workers[t]
        for _ in range(jobs_n):
            try:
                (res,) = parent.run(w, [poolipc.TensorRef(bufs[t].ptr, "float32", [64])])
                got = parent.read(res.ptr + 4, 4)
                del res  # its memory goes back to the pool
                if got != struct.pack("<f", float(t) + 0.5):
                    wrong.append((t, got))
                with lock:
                    done[0] += 1
            except (poolipc.JobFailedError, poolipc.UnknownWorkerError) as e:
                assert not isinstance(e, poolipc.WorkerError)
                typed.append(type(e).__name__)
                w = workers[t] = spawn(parent)  # a lost worker is replaced
            except BaseException as e:  # noqa: BLE001 - the test counts them
                untyped.append(repr(e))
                return

    ts = [threading.Thread(target=body, args=(t,)) for t in range(threads_n)]
    for t in ts:
        t.start()
    kills = 0
    while any(t.is_alive() for t in ts) and kills < 3:
        time.sleep(rng.uniform(0.02, 0.1))
        pid = parent.pid(rng.choice(workers))
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
                kills += 1
            except ProcessLookupError:
                pass
    for t in ts:
        t.join(60)
    assert not untyped and not wrong, (untyped, wrong)
    assert done[0] + len(typed) == threads_n * jobs_n
    assert kills >= 1
    print(f"{kills} kills, {len(typed)} typed failures: {sorted(set(typed))}")
    for w in workers:
        try:
            parent.stop(w)
        except poolipc.UnknownWorkerError:
            # Killed while idle: the parent already reaped it, and says so.
            pass
    parent.synchronize()
    assert wait_until(lambda: poolipc.memory_stats()["used_current"] == baseline, 10), (
        poolipc.memory_stats(), baseline)


def test_deadlines_are_set_once_per_process_and_a_clash_is_a_value_error(parent):
    o = parent.options
    assert o["stop_timeout"] == STOP_TIMEOUT and o["made_by"] == "install_pool"
    assert o["handoff_timeout"] == 30.0
    # the same values, or none, share the process's parent
    assert poolipc.Parent(0, stop_timeout=STOP_TIMEOUT, handoff_timeout=30.0).options == o
    with pytest.raises(ValueError, match=r"stop_timeout=7\.0 .*has 2\.0.*clashes"):
        poolipc.Parent(0, stop_timeout=7.0)
    with pytest.raises(ValueError, match="handoff_timeout=-1.0 is not a deadline"):
        poolipc.Parent(0, handoff_timeout=-1.0)
    with pytest.raises(ValueError, match="not 3; one device per process"):
        poolipc.Parent(3)


def fresh_process_lines(code: str, **env: str) -> tuple[dict[str, str], str]:
    """Runs ``code`` in a fresh interpreter on the simulated driver (``PY_WORKER`` names the
    test worker, ``env`` adds to the environment); asserts it exited 0 and returns its
    output's lines as ``{first word: the rest}``, and the output itself."""
    full = dict(os.environ, POOLIPC_DRIVER="sim", PY_WORKER=py_worker_argv()[1], **env)
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return dict(line.split(" ", 1) for line in out.stdout.splitlines()), out.stdout


def test_io_threads_is_set_once_per_process_and_its_rooms_serve_workers():
    # A fresh process: the module's parent has one IO thread.
    code = textwrap.dedent("""
        import os, struct, sys
        import poolipc
        try:
            poolipc.install_pool(0, io_threads=0)
        except ValueError as e:
            print("ZERO", e)
        poolipc.install_pool(0, io_threads=2)
        p = poolipc.Parent(0)
        print("OPTIONS", p.options["io_threads"])
        try:
            poolipc.Parent(0, io_threads=3)
        except ValueError as e:
            print("CLASH", e)
        argv = [sys.executable, os.environ["PY_WORKER"]]
        ws = [p.spawn(argv, {"POOLIPC_TEST_MODE": "echo"}) for _ in range(3)]
        buf = p.alloc(64, dtype="float32", shape=[16])
        p.write(buf.ptr, struct.pack("<16f", *range(16)))
        for w in ws:
            (r,) = p.run(w, [poolipc.TensorRef(buf.ptr, "float32", [16])])
            got = p.read(r.ptr, 64)
            assert struct.unpack("<15f", got[4:]) == tuple(float(i) for i in range(1, 16)), got
        print("BUSY", p.stats()["io_busy_ns"] > 0)
        print("STOPPED", [p.stop(w) for w in ws])
    """)
    lines, _ = fresh_process_lines(code)
    assert "io_threads=0 is not a count of IO threads" in lines["ZERO"]
    assert lines["OPTIONS"] == "2"
    assert "io_threads=3 (the process's parent has 2)" in lines["CLASH"]
    assert lines["BUSY"] == "True"
    assert lines["STOPPED"] == "[0, 0, 0]"


def test_heartbeats_carry_a_python_worker_s_long_job_past_the_deadline():
    # A fresh process with a 1 s handoff deadline: a worker that computes for 3 s and says
    # job.heartbeat() meanwhile finishes its job; the same computation without them is failed
    # at the deadline, and its worker reaped.
    code = textwrap.dedent("""
        import os, struct, sys, time
        import poolipc
        poolipc.install_pool(0, handoff_timeout=1.0)
        p = poolipc.Parent(0)
        argv = [sys.executable, os.environ["PY_WORKER"]]
        buf = p.alloc(64, dtype="float32", shape=[16])
        p.write(buf.ptr, struct.pack("<16f", *range(16)))
        for mode in ("heartbeat", "silent"):
            w = p.spawn(argv, {"POOLIPC_TEST_MODE": mode, "POOLIPC_TEST_COMPUTE_S": "3"})
            t = time.monotonic()
            try:
                (r,) = p.run(w, [poolipc.TensorRef(buf.ptr, "float32", [16])])
                got = struct.unpack("<15f", p.read(r.ptr, 64)[4:])
                print(mode.upper(), "ok", got == tuple(float(i) for i in range(1, 16)),
                      round(time.monotonic() - t, 1))
                p.stop(w)
            except poolipc.PoolipcError as e:
                print(mode.upper(), "failed", type(e).__name__, round(time.monotonic() - t, 1),
                      str(e).replace(chr(10), " "))
    """)
    lines, out = fresh_process_lines(code)
    ok, right, took = lines["HEARTBEAT"].split()[:3]
    assert (ok, right) == ("ok", "True") and float(took) >= 3.0, out
    silent = lines["SILENT"].split()
    assert silent[0] == "failed" and float(silent[2]) < 2.9, out


def test_gpu_turn_is_set_once_per_process_and_a_submit_waits_its_turn():
    # A fresh process: the simulated machine is no MPS client, so the parent keeps turns.
    code = textwrap.dedent("""
        import os, struct, sys, threading, time
        import poolipc
        try:
            poolipc.install_pool(0, gpu_turn=-1)
        except ValueError as e:
            print("NEGATIVE", e)
        poolipc.install_pool(0, gpu_turn=30.0)
        p = poolipc.Parent(0)
        print("OPTIONS", p.options["gpu_turn"])
        try:
            poolipc.Parent(0, gpu_turn=0)
        except ValueError as e:
            print("CLASH", e)
        argv = [sys.executable, os.environ["PY_WORKER"]]
        go = os.path.join(os.environ["GATE"], "go")
        held = p.spawn(argv, {"POOLIPC_TEST_MODE": "gate", "POOLIPC_TEST_GATE": go})
        free = p.spawn(argv, {"POOLIPC_TEST_MODE": "echo"})
        buf = p.alloc(64, dtype="float32", shape=[16])
        p.write(buf.ptr, struct.pack("<16f", *range(16)))
        ref = poolipc.TensorRef(buf.ptr, "float32", [16])
        h = p.submit(held, [ref])
        while p.stats()["workers_busy"] < 1:
            time.sleep(0.01)
        done = []
        t = threading.Thread(target=lambda: done.append(p.run(free, [ref])))
        t.start()
        time.sleep(0.5)
        print("WAITED", not done, p.stats()["workers_busy"])
        open(go, "w").close()
        h.wait()
        t.join()
        s = p.stats()
        print("TURNS", s["turn_waits"], s["turn_wait_ns"] >= 400_000_000, s["turn_waits_ran_out"])
        print("STOPPED", [p.stop(w) for w in (held, free)])
    """)
    with tempfile.TemporaryDirectory() as gate:
        lines, stdout = fresh_process_lines(code, GATE=gate)
    assert "gpu_turn=-1.0 is not a turn" in lines["NEGATIVE"]
    assert lines["OPTIONS"] == "30.0"
    assert "gpu_turn=0.0 (the process's parent has 30.0)" in lines["CLASH"]
    # The free worker's job waited while the held one's was in flight; one worker busy.
    assert lines["WAITED"] == "True 1", stdout
    assert lines["TURNS"] == "1 True 0", stdout
    assert lines["STOPPED"] == "[0, 0]"


def test_a_pool_parent_refuses_arena_results_per_job_and_a_clash_names_the_result_memory(parent):
    o = parent.options
    assert (o["results"], o["arena_bytes"], o["arena_max_bytes"]) == ("pool", None, None)
    assert parent.arena_stats()["enabled"] is False
    with pytest.raises(ValueError, match=r'results="arena" \(the process\'s parent has "pool"\)'):
        poolipc.Parent(0, results="arena")
    with pytest.raises(ValueError, match=r"arena_max_bytes=1024 \(the process's parent has no arena\)"):
        poolipc.Parent(0, arena_max_bytes=1024)
    with pytest.raises(ValueError, match=r"arena slices of 4096 bytes need the parent's results in the arena"):
        parent.set_arena_slice_bytes(4096)
    parent.set_arena_slice_bytes(0)  # none: nothing to refuse
    w = spawn(parent)
    f = f32_buffer(parent, [1.0] * 4)
    ref = poolipc.TensorRef(f.ptr, "float32", [4])
    with pytest.raises(ValueError, match="needs the process's parent made with results=\"arena\""):
        parent.run(w, [ref], results="arena")
    (res,) = parent.run(w, [ref], results="pool")
    assert isinstance(res, poolipc.DeviceBuffer) and parent.last_result_rungs == ["pool pointer"]
    parent.stop(w)


def test_an_input_lent_read_only_is_read_only_on_the_worker_and_a_writable_one_is_not(
        parent, report):
    w = spawn(parent, "probe", report.env)
    pooled = f32_buffer(parent, [1.5] * 4)
    # outside the shared pool, on the parent's device: copied into the arena
    staged = parent.alloc(16, dtype="float32", shape=[4], shared=False)
    parent.write(staged.ptr, struct.pack("<4f", 7.0, 8.0, 9.0, 10.0))
    out = parent.run(w, [poolipc.TensorRef(pooled.ptr, "float32", [4]),
                         poolipc.TensorRef(staged.ptr, "float32", [4])], read_only=[False, True])
    assert parent.last_input_rungs == ["pool pointer", "arena copy"]
    # the copied input's bytes crossed
    assert struct.unpack("<3f", parent.read(out[1].ptr + 4, 12)) == (8.0, 9.0, 10.0)
    parent.stop(w)  # the worker writes its report after the job ended
    (rep,) = [x for x in report.lines() if "inputs" in x]
    p, s = rep["inputs"]
    assert p["rung"] == "pool pointer" and s["rung"] == "arena copy"
    # lent writable: the parent's own memory here, writable
    assert p["read_only"] is False and p["cai"]["data"][1] is False
    assert p["capsule_versioned"]["flags"] & 1 == 0
    # lent read-only: read-only wherever a consumer can be told
    assert s["read_only"] is True and s["cai"]["data"] == [s["ptr"], True]
    assert s["capsule_versioned"]["flags"] & 1 == 1  # DLPACK_FLAG_BITMASK_READ_ONLY
    assert s["write_error"].startswith("ValueError") and "read-only" in s["write_error"]
    assert "read_only=True" in s["repr"]


@pytest.mark.parametrize("read_only", [False, True], ids=["writable", "read_only"])
def test_a_write_into_an_input_is_seen_by_the_parent_on_every_rung_or_raises(
        parent, report, read_only):
    w = spawn(parent, "write-inputs", report.env)
    pooled = f32_buffer(parent, [1.0] * 4)
    # outside the shared pool, on the parent's device: copied into the arena
    staged = parent.alloc(16, dtype="float32", shape=[4], shared=False)
    parent.write(staged.ptr, struct.pack("<4f", 1.0, 2.0, 3.0, 4.0))
    parent.run(w, [poolipc.TensorRef(pooled.ptr, "float32", [4]),
                   poolipc.TensorRef(staged.ptr, "float32", [4])], read_only=read_only)
    (rep,) = [x["writes"] for x in report.lines() if "writes" in x]
    assert [r["rung"] for r in rep] == ["pool pointer", "arena copy"]
    assert [r["read_only"] for r in rep] == [read_only, read_only]
    if not read_only:
        # the writes went through, in place (pool pointer) and copied back (arena copy)
        assert [r["write_error"] for r in rep] == [None, None]
        assert parent.read(pooled.ptr, 4) == b"\xab" * 4
        assert parent.read(staged.ptr, 16) == b"\xab" * 4 + struct.pack("<3f", 2.0, 3.0, 4.0)
    else:
        # read-only: every write raised, and the parent's tensors are as they were
        assert all(r["write_error"].startswith("ValueError") for r in rep)
        assert parent.read(pooled.ptr, 4) == struct.pack("<f", 1.0)
        assert parent.read(staged.ptr, 16) == struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    assert parent.stop(w) == 0


def test_read_only_flags_must_match_the_inputs(parent):
    w = spawn(parent)
    f = f32_buffer(parent, [1.0] * 4)
    with pytest.raises(ValueError, match="read_only has 2 flags for 1 inputs"):
        parent.submit(w, [poolipc.TensorRef(f.ptr, "float32", [4])], read_only=[True, False])
    parent.stop(w)


# --- every error typed ----------------------------------------------------------------------


def test_a_freed_device_buffer_raises_expired_view_error(parent):
    buf = parent.alloc(16)
    buf.free()
    with pytest.raises(poolipc.ExpiredViewError, match="was freed"):
        buf.ptr
    with pytest.raises(poolipc.ExpiredViewError):
        buf.data_ptr()
    buf.free()  # freeing again does nothing
    assert "freed" in repr(buf)


@pytest.mark.parametrize(
    "nbytes,dtype,shape,says",
    [
        (16, "float32", [5], "does not take 16 bytes"),
        (16, "float32", [2**40, 2**40], "does not take 16 bytes"),
        (10, "float32", None, "no whole number of float32 elements"),
        (0, "uint8", None, "nothing to allocate"),
        (16, "float33", None, "unknown dtype"),
    ],
)
def test_alloc_refuses_a_shape_that_does_not_cover_nbytes_with_value_error(
    parent, nbytes, dtype, shape, says
):
    with pytest.raises(ValueError, match=says) as e:
        parent.alloc(nbytes, dtype=dtype, shape=shape)
    assert not isinstance(e.value, poolipc.PoolipcError)


def test_a_read_too_large_for_any_host_buffer_is_a_memory_error_not_an_abort(parent):
    buf = parent.alloc(16)
    with pytest.raises(MemoryError, match="no host buffer"):
        parent.read(buf.ptr, 2**62)


@pytest.mark.parametrize("device", [-1, "0", 1.0, True])
def test_a_device_that_is_no_ordinal_is_a_value_or_type_error(parent, device):
    want = ValueError if isinstance(device, int) and not isinstance(device, bool) else TypeError
    with pytest.raises(want, match="ordinal"):
        poolipc.Parent(device)
    with pytest.raises(want, match="ordinal"):
        poolipc.install_pool(device)


def test_spawn_of_a_string_instead_of_a_list_is_a_type_error(parent):
    with pytest.raises(TypeError, match="argv must be a list"):
        parent.spawn(sys.executable)
    with pytest.raises(ValueError, match="empty argv"):
        parent.spawn([])


def test_a_stream_that_is_no_handle_is_a_type_error(parent):
    buf = parent.alloc(16)
    with pytest.raises(TypeError, match="stream must be"):
        parent.submit(1, [poolipc.TensorRef(buf.ptr, "uint8", [16])], stream="0")


def test_worker_side_errors_are_typed_and_finishing_from_two_threads_finishes_once(parent, report):
    # A result shape too large to count is a ValueError before anything is asked; two threads
    # finishing one job at once: one finishes, the other gets ExpiredViewError (the native
    # classes are frozen: no "Already borrowed" can reach Python).
    w = spawn(parent, "typed-errors", report.env)
    f = f32_buffer(parent, [1.0] * 4)
    assert parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [4])]) == []
    assert parent.stop(w) == 0
    (rep,) = [x for x in report.lines() if "too_large" in x]
    assert rep["too_large"].startswith("ValueError: poolipc: result 0: shape"), rep
    assert rep["finish_twice"] == ["ExpiredViewError", "ok"], rep


# --- the typed, documented surface ---------------------------------------------------------

# Protocol methods a user calls through syntax or a consumer (torch, CuPy) calls: documented too.
DOCUMENTED_DUNDERS = {"__init__", "__new__", "__iter__", "__enter__", "__exit__", "__dlpack__",
                      "__dlpack_device__", "__cuda_array_interface__"}


def own_doc(obj):
    """The object's own docstring, stripped ('' when it has none of its own)."""
    doc = obj.__doc__ if isinstance(obj, type) else getattr(obj, "__doc__", None)
    if isinstance(obj, type) and "__doc__" not in vars(obj):
        return ""
    return (doc or "").strip()


def test_every_public_name_and_member_has_a_docstring():
    import inspect

    missing = []
    for name in poolipc.__all__:
        obj = getattr(poolipc, name)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            # constants and type aliases: said in the module's docstring
            if f"``{name}``" not in poolipc.__doc__:
                missing.append(name)
            continue
        if not own_doc(obj):
            missing.append(name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for member, value in vars(obj).items():
                if member.startswith("_") and member not in DOCUMENTED_DUNDERS:
                    continue
                if issubclass(obj, enum.Enum) and member == "__new__":
                    # the enum machinery's constructor: the class's docstring says what it takes
                    continue
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                slots = vars(obj).get("__slots__")
                if isinstance(slots, dict) and member in slots:
                    # a slot's docstring (help() shows it; the descriptor has it from 3.13)
                    value = types.SimpleNamespace(__doc__=slots[member])
                if not (getattr(value, "__doc__", None) or "").strip():
                    missing.append(f"{name}.{member}")
    assert not missing, f"no docstring: {missing}"


def test_help_on_parent_names_the_constructor_arguments_the_methods_and_what_they_raise():
    import pydoc

    text = pydoc.render_doc(poolipc.Parent, renderer=pydoc.plaintext)
    for word in ("handoff_timeout", "stop_timeout", "run(self", "submit(self", "spawn(self",
                 "ValueError", "JobFailedError", "WorkerError", "UnknownWorkerError"):
        assert word in text, word
    native = pydoc.render_doc(poolipc._native.NativeWorker, renderer=pydoc.plaintext)
    assert "NativeWorker(device=0, any=False)" in native and "PoolipcError" in native


def test_the_package_ships_its_stubs_and_py_typed():
    from importlib import resources

    root = resources.files("poolipc")
    assert (root / "py.typed").is_file()
    assert (root / "_native.pyi").is_file()


def run_mypy(*args, cwd):
    pytest.importorskip("mypy", reason="mypy is not installed here (cargo xtask installs it)")
    env = dict(os.environ, POOLIPC_DRIVER="sim")
    p = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr


def test_the_stubs_and_the_native_module_have_the_same_names_and_signatures(tmp_path):
    # stubtest imports the module and compares every name, signature and default with the .pyi
    # The allowlist: what stubtest cannot compare (an enum's generated constructor).
    allow = pathlib.Path(__file__).resolve().parent / "typed" / "stubtest-allowlist.txt"
    rc, out = run_mypy("mypy.stubtest", "poolipc", "--mypy-config-file", os.devnull,
                       "--allowlist", str(allow), cwd=tmp_path)
    assert rc == 0, out


def test_a_typed_use_of_every_public_name_passes_mypy_strict(tmp_path):
    usage = pathlib.Path(__file__).resolve().parent / "typed" / "usage.py"
    rc, out = run_mypy("mypy", "--strict", "--no-incremental", "--config-file", os.devnull,
                       str(usage), cwd=tmp_path)
    assert rc == 0, out


# --- install_pool ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "option,value,error,says",
    [
        ("io_threads", "2", TypeError, "io_threads='2' is not a whole number"),
        ("io_threads", 2.5, TypeError, "io_threads=2.5 is not a whole number"),
        ("io_threads", True, TypeError, "io_threads=True is not a whole number"),
        ("io_threads", -1, ValueError, "io_threads=-1 is negative"),
        ("arena_bytes", -5, ValueError, "arena_bytes=-5 is negative"),
        ("handoff_timeout", "5", TypeError, "handoff_timeout='5' is not a number of seconds"),
        ("isolated", "yes", TypeError, "isolated='yes' is not True or False"),
        ("results", 1, TypeError, "results=1 is not a string"),
    ],
)
def test_an_option_of_the_wrong_type_is_refused_naming_it_and_its_value(parent, option, value, error, says):
    # Before anything is made or compared with the process parent's options.
    for call in (lambda: poolipc.install_pool(0, **{option: value}),
                 lambda: poolipc.Parent(0, **{option: value})):
        with pytest.raises(error) as e:
            call()
        assert says in str(e.value), str(e.value)
    # The process parent goes on.
    assert parent.stats()["workers_lost"] >= 0


def test_install_pool_refuses_once_torch_is_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    with pytest.raises(poolipc.PoolipcError, match=r"torch is already imported.*before `import torch`"):
        poolipc.install_pool(0)


@pytest.mark.parametrize(
    "conf,argv,new,no_effect",
    [
        (None, [], "backend:cudaMallocAsync", None),
        ("", [], "backend:cudaMallocAsync", None),
        ("expandable_segments:True", [], "expandable_segments:True,backend:cudaMallocAsync", None),
        ("backend:cudaMallocAsync", [], None, None),
        ("backend:cudaMallocAsync,backend:cudaMallocAsync", [], None, None),
        ("backend:native", [], None, "chose another allocator backend"),
        (None, ["main.py", "--disable-cuda-malloc"], None, "--disable-cuda-malloc"),
    ],
)
def test_the_allocator_setting_is_left_to_the_user_who_chose(conf, argv, new, no_effect):
    got_new, reason = poolipc._backend_choice(conf, argv)
    assert got_new == new
    assert (reason is None) == (no_effect is None)
    if no_effect:
        assert no_effect in reason


# --- the ComfyUI prestartup script, in a fresh interpreter ---------------------------------

RUN_PRESTARTUP = textwrap.dedent(
    """
    import importlib.util, os, sys
    sys.argv = {argv!r}
    {before}
    # what ComfyUI's main.py does with custom_nodes/<pack>/prestartup_script.py
    spec = importlib.util.spec_from_file_location("prestartup_script", {path!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    print("STARTUP CONTINUES", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    """
)


def run_prestartup(env_extra, argv=("main.py",), before=""):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "POOLIPC_ENABLE")}
    env.update(env_extra)
    code = RUN_PRESTARTUP.format(argv=list(argv), before=before, path=str(PRESTARTUP))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "STARTUP CONTINUES" in p.stdout, p.stdout + p.stderr
    return p.stdout, p.stderr


def test_prestartup_does_nothing_unless_enabled():
    out, err = run_prestartup({"POOLIPC_DRIVER": "sim"})
    assert "poolipc" not in err
    assert out.strip().endswith("None")


def test_prestartup_swaps_the_pool_and_says_what_torch_will_show():
    out, err = run_prestartup({"POOLIPC_ENABLE": "1", "POOLIPC_DRIVER": "sim"})
    lines = [x for x in err.splitlines() if x.startswith("poolipc:")]
    assert len(lines) == 1, err
    assert "installed a shareable CUDA memory pool as device 0's current pool" in lines[0]
    assert "memory_stats(), memory_allocated() and memory_reserved() will report the pool" in lines[0]
    assert "POOLIPC_TORCH_STATS=0" in lines[0] and "poolipc.memory_stats()" in lines[0]
    assert out.strip().endswith("backend:cudaMallocAsync")


def test_prestartup_keeps_a_backend_comfyui_already_chose():
    out, err = run_prestartup(
        {"POOLIPC_ENABLE": "1", "POOLIPC_DRIVER": "sim", "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    )
    assert "current pool" in err
    assert out.strip().endswith(" backend:cudaMallocAsync")


def test_prestartup_with_disable_cuda_malloc_says_the_swap_has_no_effect():
    out, err = run_prestartup(
        {"POOLIPC_ENABLE": "1", "POOLIPC_DRIVER": "sim"}, argv=("main.py", "--disable-cuda-malloc")
    )
    assert "the swap has no effect" in err and "--disable-cuda-malloc" in err
    # Once: before logging is configured, logging's last-resort handler would print it too.
    assert err.count("the swap has no effect") == 1, err
    assert out.strip().endswith("None")  # the user's choice stands: no backend was set


def test_prestartup_with_another_backend_says_the_swap_has_no_effect():
    out, err = run_prestartup(
        {"POOLIPC_ENABLE": "1", "POOLIPC_DRIVER": "sim", "PYTORCH_CUDA_ALLOC_CONF": "backend:native"}
    )
    assert "the swap has no effect" in err and "backend:native" in err
    assert out.strip().endswith("backend:native")


def test_a_prestartup_failure_is_logged_and_startup_goes_on():
    out, err = run_prestartup({"POOLIPC_ENABLE": "1", "POOLIPC_DRIVER": "no-such-driver"})
    assert "poolipc: not enabled" in err and "no-such-driver" in err and "ComfyUI starts as before" in err


def test_prestartup_after_torch_was_imported_is_logged_and_startup_goes_on():
    out, err = run_prestartup(
        {"POOLIPC_ENABLE": "1", "POOLIPC_DRIVER": "sim"},
        before="import types; sys.modules['torch'] = types.ModuleType('torch')",
    )
    assert "poolipc: not enabled" in err and "torch is already imported" in err


def test_prestartup_without_the_module_is_logged_and_startup_goes_on():
    out, err = run_prestartup(
        {"POOLIPC_ENABLE": "1", "POOLIPC_DRIVER": "sim"},
        before="sys.modules['poolipc'] = None  # as if the wheel were not installed",
    )
    assert "poolipc: not enabled" in err and "pip install" in err


# --- the storm: threads, fresh inputs made by GPU work, every byte checked ---------------------

STORM_WORKER = REPO / "bench" / "storm_worker.py"


def _storm(jobs, kill_one_in=None, threads=4):
    """``threads`` threads, each with its own ``poolipc.Parent`` object and torch-free worker,
    ``jobs`` jobs in all: each lends a fresh pool allocation filled by GPU work (``fill``,
    queued on the stream the job is submitted on) just before the lend, and checks that the
    worker's answer is the input XOR 0xA5, read on that stream. Returns the tally."""
    import random

    tally = {"ok": 0, "wrong": 0, "killed": 0, "errors": []}
    lock = threading.Lock()

    def run(t):
        rng = random.Random(1000 + t)
        p = poolipc.Parent(0)
        env = {"STORM_WORKER": "bytes"}
        w = p.spawn([sys.executable, str(STORM_WORKER)], env)
        for _ in range(jobs // threads):
            n = rng.randint(4096, 64 * 1024)
            value = rng.randrange(256)
            buf = p.alloc(n)
            p.fill(buf.ptr, n, value)  # GPU work on stream 0, still queued when lent
            kill = kill_one_in is not None and rng.randrange(kill_one_in) == 0
            try:
                h = p.submit(w, [poolipc.TensorRef(buf.ptr, "uint8", [n])])
                if kill:
                    time.sleep(rng.random() * 0.002)
                    pid = p.pid(w)
                    if pid:
                        os.kill(pid, signal.SIGKILL)
                (r,) = h.wait()
                got = p.read(r.ptr, n, stream=0)
                good = r.nbytes == n and got == bytes([value ^ 0xA5]) * n
                with lock:
                    if good:
                        tally["ok"] += 1
                    elif kill:
                        # Killed after its DONE: the simulation drops a dead process's
                        # queued GPU work (see tests/tests/storm.rs).
                        tally["killed"] += 1
                    else:
                        tally["wrong"] += 1
                del r
            except poolipc.PoolipcError as e:
                with lock:
                    if kill:
                        tally["killed"] += 1
                    else:
                        tally["errors"].append(repr(e))
            except Exception as e:  # noqa: BLE001  (an untyped error is what the storm counts)
                with lock:
                    tally["errors"].append("untyped: " + repr(e))
            del buf
            if kill:
                try:
                    p.stop(w)
                except poolipc.UnknownWorkerError:
                    pass  # already reaped: the kill was seen first
                w = p.spawn([sys.executable, str(STORM_WORKER)], env)
        p.stop(w)

    ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return tally


def _used():
    # No gc.collect(): what the storm held must go back by reference counting alone (a
    # failed job's stored error once kept its caller's frame, and so its buffers, alive).
    return poolipc.memory_stats()["used_current"]


def test_a_storm_of_fresh_inputs_over_four_torch_free_workers_gets_every_byte_right(parent):
    base = _used()
    t = _storm(1000)
    assert t["wrong"] == 0 and not t["errors"], t
    assert t["ok"] == 1000, t
    assert wait_until(lambda: _used() == base), (base, _used())


def test_a_storm_with_random_kills_gets_every_surviving_byte_right_and_leaves_nothing(parent):
    base = _used()
    t = _storm(200, kill_one_in=20)
    assert t["wrong"] == 0 and not t["errors"], t
    assert t["ok"] + t["killed"] == 200, t
    assert wait_until(lambda: _used() == base), (base, _used())


def test_a_stream_that_is_none_of_this_process_is_a_value_error(parent):
    buf = parent.alloc(64)
    for call in (
        lambda: parent.read(buf.ptr, 8, stream=0xDEAD0),
        lambda: parent.write(buf.ptr, b"x", stream=0xDEAD0),
        lambda: parent.fill(buf.ptr, 8, 1, stream=0xDEAD0),
        lambda: parent.synchronize(0xDEAD0),
        lambda: parent.alloc(64, stream=0xDEAD0),
        lambda: parent.submit(0, [poolipc.TensorRef(buf.ptr, "uint8", [64])], stream=0xDEAD0),
    ):
        with pytest.raises(ValueError, match="not a CUDA stream of this process"):
            call()
    # And the parent goes on working.
    parent.fill(buf.ptr, 8, 7)
    assert parent.read(buf.ptr, 8, stream=0) == b"\x07" * 8



def test_a_job_on_the_per_thread_default_stream_is_a_value_error_naming_it(parent):
    # CU_STREAM_PER_THREAD (2) names the calling thread's default stream; the parent's IO
    # thread records READY and allocates results on the job's stream, and cannot reach it.
    # Refused before anything reaches the worker, which takes the next job.
    w = spawn(parent)
    vals = [1.5, 2.5, 3.5, 4.5]
    buf = f32_buffer(parent, vals)
    ref = poolipc.TensorRef(buf.ptr, "float32", [4])
    with pytest.raises(ValueError, match="CU_STREAM_PER_THREAD"):
        parent.submit(w, [ref], stream=2)
    (res,) = parent.run(w, [ref], stream=0)
    got = parent.read(res.ptr, 16)
    assert struct.unpack("<3f", got[4:]) == tuple(vals[1:])
    assert parent.stop(w) == 0


# --- VRAM goes back: empty_cache trims the pool ---------------------------------------------


def test_empty_cache_gives_the_pools_unused_memory_back(parent):
    # After a worker is reaped the IO loop trims the pool for a second (a killed worker's
    # results go back to the device); an earlier test's reaping would then trim what this one
    # frees before empty_cache could. Wait that window out, so empty_cache alone is measured.
    time.sleep(1.5)
    big = parent.alloc(256 << 20)
    parent.fill(big.ptr, 256 << 20, 1)
    held = poolipc.memory_stats()
    assert held["reserved_current"] >= 256 << 20
    del big  # freed stream-ordered: the pool keeps the memory (its release threshold)
    assert poolipc.memory_stats()["reserved_current"] >= 256 << 20
    released = poolipc.empty_cache()
    after = poolipc.memory_stats()
    assert released >= 256 << 20, (released, held, after)
    # What is left is what live allocations use (rounded to the pool's granule).
    assert after["reserved_current"] - after["used_current"] < 256 << 20, after


def test_empty_cache_gives_memory_lent_by_pool_pointer_back_and_the_figures_stay_right(parent):
    w = spawn(parent)
    s0 = poolipc.memory_stats()
    free0, _ = poolipc.mem_get_info()
    n = 128 << 20
    buf = parent.alloc(n, dtype="float32", shape=[n // 4])
    parent.fill(buf.ptr, n, 3)
    (res,) = parent.run(w, [poolipc.TensorRef(buf.ptr, "float32", [n // 4])])
    assert parent.last_input_rungs == ["pool pointer"]
    del res, buf
    parent.synchronize()
    # Lent (exported) and freed: the pool's figures drop, the device's free memory does not.
    held = free0 - poolipc.mem_get_info()[0]
    poolipc.empty_cache()
    free1, _ = poolipc.mem_get_info()
    assert free1 + (64 << 20) >= free0, (free0, free1, held)
    after = poolipc.memory_stats()
    assert after["used_current"] == s0["used_current"], (s0, after)
    assert after["reserved_current"] - after["used_current"] < n, after
    # The worker keeps serving from the new pool generation; the figures follow it.
    vals = [1.5] * 64
    f = f32_buffer(parent, vals)
    assert poolipc.memory_stats()["used_current"] >= after["used_current"] + 256
    (res,) = parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [64])])
    assert parent.last_input_rungs == ["pool pointer"]
    got = parent.read(res.ptr, 256)
    assert struct.unpack("<63f", got[4:]) == tuple(vals[1:])
    assert parent.stop(w) == 0


def test_torch_empty_cache_also_trims_the_pool_once_patched(parent):
    calls = []
    fake_cuda = types.SimpleNamespace(empty_cache=lambda: calls.append("torch"))
    poolipc._patch_torch_empty_cache(fake_cuda)
    poolipc._patch_torch_empty_cache(fake_cuda)  # once only
    buf = parent.alloc(64 << 20)
    del buf
    before = poolipc.memory_stats()["reserved_current"]
    fake_cuda.empty_cache()
    assert calls == ["torch"]
    assert poolipc.memory_stats()["reserved_current"] <= before - (64 << 20)


# --- torch's memory figures report the pool -------------------------------------------------

# The pack's stand-in for torch.cuda: torch 2.11's wiring of the memory figures, its own
# figures (the default pool's) set by the test.
FAKE_TORCH = REPO / "comfyui-poolipc" / "tests" / "fake_torch"
_fake_cudas = itertools.count()
MIB = 1 << 20


def fake_torch_cuda():
    """A fresh copy of the fake torch.cuda under a name of its own: this process never
    imports a module called torch."""
    name = f"fake_torch_cuda_{next(_fake_cudas)}"
    where = FAKE_TORCH / "torch" / "cuda"
    spec = importlib.util.spec_from_file_location(
        name, where / "__init__.py", submodule_search_locations=[str(where)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def patched_cuda():
    cuda = fake_torch_cuda()
    poolipc._patch_torch_memory_stats(cuda, 0)
    return cuda


def torch_figures(cuda, device):
    return (cuda.memory_allocated(device), cuda.memory_reserved(device),
            cuda.max_memory_allocated(device), cuda.max_memory_reserved(device))


def pool_figures():
    s = poolipc.memory_stats()
    return (s["used_current"], s["reserved_current"], s["used_high"], s["reserved_high"])


def test_torchs_figures_are_the_pools_while_a_tensor_lives_and_after_it_dies(parent):
    cuda = patched_cuda()
    big = parent.alloc(96 * MIB)
    parent.fill(big.ptr, 96 * MIB, 3)
    living = pool_figures()
    assert living[0] >= 96 * MIB and living[1] >= living[0], living
    for device in (None, 0, "cuda:0", "cuda"):
        assert torch_figures(cuda, device) == living, device
    stats = cuda.memory_stats(0)
    assert stats["active_bytes.all.current"] == stats["allocated_bytes.all.current"] == living[0]
    del big
    parent.synchronize(0)
    dead = pool_figures()
    assert dead[0] <= living[0] - 96 * MIB, (living, dead)
    assert dead[1] >= living[1], (living, dead)  # the pool keeps freed memory (its threshold)
    assert torch_figures(cuda, 0) == dead


def flat(nested, prefix=""):
    """torch's nested statistics as memory_stats() keys them."""
    out = {}
    for k, v in nested.items():
        key = f"{prefix}.{k}" if prefix else k
        out.update(flat(v, key) if isinstance(v, dict) else {key: v})
    return out


def test_torchs_statistics_get_the_pools_bytes_and_keep_every_other_key(parent):
    cuda = patched_cuda()
    cuda._C.own[0] = (5 * MIB, 9 * MIB)  # what torch's default pool says: replaced, not added
    buf = parent.alloc(8 * MIB)
    pool = poolipc.memory_stats()
    stats = cuda.memory_stats(0)
    ours = {
        "allocated_bytes.all.current": pool["used_current"],
        "allocated_bytes.all.peak": pool["used_high"],
        "active_bytes.all.current": pool["used_current"],
        "active_bytes.all.peak": pool["used_high"],
        "reserved_bytes.all.current": pool["reserved_current"],
        "reserved_bytes.all.peak": pool["reserved_high"],
    }
    assert {k: stats[k] for k in ours} == ours
    own = flat(cuda._C._cuda_memoryStats(0))
    assert set(stats) == set(own)
    assert {k: v for k, v in stats.items() if k not in ours} == {
        k: v for k, v in own.items() if k not in ours
    }
    assert stats["allocated_bytes.large_pool.current"] == 5 * MIB  # torch's, kept
    del buf


def test_torchs_figures_for_another_device_are_torchs_own(parent):
    cuda = patched_cuda()
    cuda._C.own[1] = (5 * MIB, 8 * MIB)
    assert torch_figures(cuda, 1) == (5 * MIB, 8 * MIB, 5 * MIB, 8 * MIB)
    assert cuda.memory_allocated("cuda:1") == 5 * MIB
    assert dict(cuda.memory_stats(1)) == flat(cuda._C._cuda_memoryStats(1))
    with cuda.device(1):
        assert cuda.memory_reserved() == 8 * MIB  # None: the current device


def test_until_torch_starts_cuda_its_answer_stands(parent):
    cuda = patched_cuda()
    cuda._C.initialized = False
    buf = parent.alloc(4 * MIB)
    assert cuda.memory_stats(0) == {} and cuda.memory_allocated(0) == 0
    del buf


def test_the_pools_peaks_restart_from_the_current_figures(parent):
    big = parent.alloc(128 * MIB)
    del big
    parent.synchronize(0)
    used, reserved, used_high, reserved_high = pool_figures()
    assert used_high >= used + 128 * MIB
    poolipc.reset_peak_memory_stats()
    assert pool_figures() == (used, reserved, used, reserved)


def test_torchs_reset_peak_memory_stats_restarts_the_pools_peaks_and_torchs_own(parent):
    cuda = patched_cuda()
    for reset in (cuda.reset_peak_memory_stats, cuda.memory.reset_peak_memory_stats,
                  cuda.reset_max_memory_allocated):
        big = parent.alloc(64 * MIB)
        del big
        parent.synchronize(0)
        used, reserved, used_high, _ = pool_figures()
        assert cuda.max_memory_allocated(0) == used_high >= used + 64 * MIB
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # reset_max_memory_allocated's
            reset(0)
        assert pool_figures() == (used, reserved, used, reserved), reset
        assert cuda.max_memory_allocated(0) == used and cuda.max_memory_reserved(0) == reserved
    assert cuda._C.peak_resets == [0, 0, 0]  # torch's own reset ran each time


def test_torchs_reset_for_another_device_leaves_the_pools_peaks(parent):
    cuda = patched_cuda()
    big = parent.alloc(64 * MIB)
    del big
    parent.synchronize(0)
    before = pool_figures()
    assert before[2] > before[0]
    cuda.reset_peak_memory_stats(1)
    assert pool_figures() == before
    assert cuda._C.peak_resets == [1]


def test_the_figures_are_patched_once(parent):
    cuda = patched_cuda()
    wrapper = cuda.memory_stats_as_nested_dict
    poolipc._patch_torch_memory_stats(cuda, 0)
    assert cuda.memory_stats_as_nested_dict is wrapper is cuda.memory.memory_stats_as_nested_dict
    assert not getattr(wrapper.__wrapped__, "_poolipc", False)


def test_a_torch_without_the_wrapped_functions_is_left_alone_and_said_so(parent, caplog):
    cuda = types.SimpleNamespace(memory=types.SimpleNamespace(memory_stats=lambda device=None: {}))
    with caplog.at_level("WARNING", logger="poolipc"):
        poolipc._patch_torch_memory_stats(cuda, 0)
    assert "has no memory_stats_as_nested_dict, reset_peak_memory_stats, is_initialized" in caplog.text
    assert vars(cuda.memory).keys() == {"memory_stats"}


def test_a_torch_cuda_already_loaded_is_patched_at_once(parent, monkeypatch):
    cuda = fake_torch_cuda()
    monkeypatch.setitem(sys.modules, "torch.cuda", cuda)
    monkeypatch.delenv("POOLIPC_TORCH_STATS", raising=False)
    poolipc._hook_torch(0, effective=True)
    assert getattr(cuda.memory_stats_as_nested_dict, "_poolipc", False)
    assert getattr(cuda.memory.reset_peak_memory_stats, "_poolipc", False)


# install_pool, then `import torch.cuda` (the fake, first on sys.path) in a fresh interpreter.
FIGURES = textwrap.dedent("""
    import json, sys
    sys.argv = {argv!r}
    import poolipc
    info = poolipc.install_pool(0)
    sys.path.insert(0, {fake!r})
    import torch.cuda
    buf = poolipc.Parent(0).alloc(64 << 20)
    pool = poolipc.memory_stats()
    print("FIGURES " + json.dumps({{
        "torch": [torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)],
        "pool": [pool["used_current"], pool["reserved_current"]],
        "patched": getattr(torch.cuda.memory_stats_as_nested_dict, "_poolipc", False),
        "empty_cache_patched": getattr(torch.cuda.empty_cache, "_poolipc", False),
    }}))
""")


def figures_after_import(env=None, argv=("main.py",)):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("POOLIPC_", "PYTORCH_"))}
    full.update({"POOLIPC_DRIVER": "sim"}, **(env or {}))
    code = FIGURES.format(argv=list(argv), fake=str(FAKE_TORCH))
    p = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.split("FIGURES ", 1)[1]), p.stderr


def test_after_install_pool_importing_torch_cuda_makes_its_figures_the_pools():
    got, err = figures_after_import()
    assert got["patched"] and got["empty_cache_patched"]
    assert got["torch"] == got["pool"] and got["pool"][0] >= 64 << 20, got
    assert "will report the pool (POOLIPC_TORCH_STATS=0: they read 0)" in err


def test_POOLIPC_TORCH_STATS_0_leaves_torchs_figures_alone():
    got, err = figures_after_import({"POOLIPC_TORCH_STATS": "0"})
    assert not got["patched"] and got["empty_cache_patched"]
    assert got["torch"] == [0, 0] and got["pool"][0] >= 64 << 20, got
    assert "memory_allocated() and memory_reserved() will read 0" in err


def test_when_the_swap_does_not_reach_torch_its_figures_stay_its_own():
    got, err = figures_after_import(argv=("main.py", "--disable-cuda-malloc"))
    assert not got["patched"] and got["torch"] == [0, 0], got
    assert "the swap has no effect" in err


def test_a_job_cancelled_mid_flight_fails_with_cancelled_and_the_worker_takes_the_next(
    parent, report, tmp_path
):
    gate, env = gate_env(report, tmp_path)
    w = spawn(parent, "gate", env)
    f = f32_buffer(parent, [3.5] * 8)
    h = parent.submit(w, [poolipc.TensorRef(f.ptr, "float32", [8])])
    assert wait_until(lambda: entered(report) == {parent.pid(w)})
    h.cancel()
    h.cancel()  # twice is once
    gate.touch()
    with pytest.raises(poolipc.JobFailedError) as e:
        h.wait(timeout=60)
    assert e.value.reason == "cancelled" and e.value.worker == w
    h.cancel()  # after the end: left as it is
    (res,) = parent.run(w, [poolipc.TensorRef(f.ptr, "float32", [8])])
    assert parent.read(res.ptr + 4, 4) == struct.pack("<f", 3.5)
    assert parent.stop(w) == 0


def test_dtypes_reach_python_as_values_that_are_still_their_names(parent):
    import json

    d = poolipc.DType("torch.float32")
    assert d is poolipc.DType.float32 and d == "float32" and str(d) == "float32"
    assert f"{d}" == "float32" and json.dumps({"dtype": d}) == '{"dtype": "float32"}'
    assert poolipc.DType("bfloat16") is poolipc.DType.bfloat16
    with pytest.raises(ValueError):
        poolipc.DType("float33")
    w = spawn(parent)
    buf = f32_buffer(parent, [1.0] * 16)
    assert isinstance(buf.dtype, poolipc.DType) and buf.dtype == "float32"
    seen = []

    def alloc(dtype, shape, nbytes):
        seen.append(dtype)
        return parent.alloc(nbytes, dtype=dtype, shape=list(shape))

    (res,) = parent.run(w, [poolipc.TensorRef(buf.ptr, poolipc.DType.float32, [16])], alloc=alloc)
    assert seen == [poolipc.DType.float32] and isinstance(seen[0], poolipc.DType)
    assert parent.stop(w) == 0
