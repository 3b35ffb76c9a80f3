"""Results through the result arena, in the binding, on the simulated driver: ArenaResult's
bytes and rung, its DLPack capsules and their deleters (consumed or not, the object dropped
before or after, called from a thread without the GIL), many results, the cap, and the choice
of result memory per job.

The process's parent is made once and sets the result memory, and test_sim.py's is a pool
parent: so each test here runs in a fresh interpreter (a child pytest of this file, with
POOLIPC_ARENA_CHILD set), whose parent has results="arena".
"""

import ctypes
import functools
import gc
import os
import struct
import sys
import threading
import time

import pytest

os.environ.setdefault("POOLIPC_DRIVER", "sim")
if os.environ["POOLIPC_DRIVER"] != "sim":
    pytest.skip("test_arena.py runs on the simulated driver only", allow_module_level=True)
if "torch" in sys.modules:
    pytest.skip("torch is imported in this process; run test_arena.py in its own pytest process",
                allow_module_level=True)

import poolipc  # noqa: E402

from conftest import py_worker_argv, run_in_child_pytest  # noqa: E402

CHILD = os.environ.get("POOLIPC_ARENA_CHILD") == "1"
MIB = 1 << 20
ARENA_BYTES = 4 * MIB
# Room for the canary battery's results (its largest is 80 MiB): a cap below them fails those
# canaries, and the worker is then served by host staging.
ARENA_MAX = 128 * MIB
OVER_CAP = 256 * MIB


def own_process(test):
    """Runs the test in a child pytest of this file (a fresh interpreter whose first parent
    has the arena); in the child, runs it."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        if CHILD:
            return test(*args, **kwargs)
        run_in_child_pytest(__file__, kwargs["request"], {"POOLIPC_ARENA_CHILD": "1"})

    return run


@pytest.fixture(scope="module")
def parent():
    if not CHILD:
        return None
    info = poolipc.install_pool(0, results="arena", arena_bytes=ARENA_BYTES, arena_max_bytes=ARENA_MAX)
    assert info["installed"] and "SIMULATED" in info["driver"]
    return poolipc.Parent(0)


def spawn(parent):
    return parent.spawn(py_worker_argv(), {"POOLIPC_TEST_MODE": "echo"})


def buffer_of(parent, data, dtype="uint8", shape=None):
    buf = parent.alloc(len(data), dtype=dtype, shape=shape)
    parent.write(buf.ptr, data)
    return buf


def echoed(data, i=0):
    """What the echo worker writes for input `i` holding `data`: the same bytes, its first
    32-bit word replaced by 0xEC40_0000 | i."""
    out = bytearray(data)
    if len(out) >= 4:
        out[0:4] = struct.pack("<I", 0xEC400000 | i)
    return bytes(out)


def pattern(n, seed=7):
    return bytes((seed + 31 * k) & 0xFF for k in range(n))


def live(parent):
    s = parent.arena_stats()
    return s["live_blocks"], s["results_out"]


def settled(parent, want, timeout=10.0):
    """Arena figures once they reach `want` (a block given back is reclaimed once its event
    completed); what they are after `timeout` otherwise."""
    end = time.monotonic() + timeout
    while True:
        got = live(parent)
        if got == want or time.monotonic() > end:
            return got
        time.sleep(0.01)


# --- ctypes: a DLPack consumer, the way torch consumes a capsule ---------------------------


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                            ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor)))]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


DLManagedTensorVersioned._fields_ = [
    ("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))),
    ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]

api = ctypes.pythonapi
api.PyCapsule_GetPointer.restype = ctypes.c_void_p
api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
api.PyCapsule_GetName.restype = ctypes.c_char_p
api.PyCapsule_GetName.argtypes = [ctypes.py_object]
api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
api.PyCapsule_SetName.restype = ctypes.c_int


class Consumed:
    """A capsule taken the way torch takes one: renamed `used_...`, its tensor read; `delete()`
    calls the deleter once (a ctypes call: the GIL is released while it runs)."""

    def __init__(self, cap):
        self.name = api.PyCapsule_GetName(cap).decode()
        self.versioned = self.name == "dltensor_versioned"
        self.ptr = api.PyCapsule_GetPointer(cap, self.name.encode())
        kind = DLManagedTensorVersioned if self.versioned else DLManagedTensor
        self.kind = kind
        self.m = ctypes.cast(self.ptr, ctypes.POINTER(kind)).contents
        t = self.m.dl_tensor
        self.data = t.data
        self.device = (t.device.device_type, t.device.device_id)
        self.dtype = (t.dtype.code, t.dtype.bits, t.dtype.lanes)
        self.shape = [t.shape[i] for i in range(t.ndim)]
        self.strides = [t.strides[i] for i in range(t.ndim)]
        self.version = (self.m.major, self.m.minor) if self.versioned else None
        assert api.PyCapsule_SetName(cap, b"used_" + self.name.encode()) == 0

    def delete(self):
        self.m.deleter(ctypes.cast(self.ptr, ctypes.POINTER(self.kind)))


# --- tests -----------------------------------------------------------------------------------


@own_process
def test_an_arena_result_holds_the_workers_bytes_and_its_rung_is_arena(parent, request):
    w = spawn(parent)
    data = pattern(4096 * 3 + 5)
    src = buffer_of(parent, data)
    before = parent.stats()["arena_results"]
    (r,) = parent.run(w, [poolipc.TensorRef(src.ptr, "uint8", [len(data)])])
    assert isinstance(r, poolipc.ArenaResult)
    assert r.rung == "arena" and parent.last_result_rungs == ["arena"]
    assert r.nbytes == len(data) and r.shape == (len(data),) and r.dtype == "uint8"
    assert r.data_ptr() == r.ptr and r.live_exports == 0
    assert parent.read(r.ptr, r.nbytes) == echoed(data)
    assert parent.stats()["arena_results"] == before + 1
    s = parent.arena_stats()
    assert s["enabled"] and s["created"] and s["max_bytes"] == ARENA_MAX
    assert (s["live_blocks"], s["results_out"]) == (1, 1) and s["used"] >= len(data)
    del r
    assert settled(parent, (0, 0)) == (0, 0)
    parent.stop(w)


@own_process
def test_a_float32_arena_result_describes_itself_by_dlpack_and_cuda_array_interface(parent, request):
    w = spawn(parent)
    values = [float(i) + 0.5 for i in range(12)]
    src = buffer_of(parent, struct.pack("<12f", *values), dtype="float32", shape=[3, 4])
    (r,) = parent.run(w, [poolipc.TensorRef(src.ptr, "float32", [3, 4])])
    assert r.shape == (3, 4) and r.dtype == "float32"
    assert r.__dlpack_device__() == (2, 0)
    cai = r.__cuda_array_interface__
    assert cai["shape"] == (3, 4) and cai["typestr"] == "<f4" and cai["data"] == (r.ptr, False)
    assert cai["strides"] == (16, 4) and cai["version"] == 3
    c = Consumed(r.__dlpack__(stream=-1, max_version=(1, 0)))
    assert c.name == "dltensor_versioned" and c.version == (1, 0)
    assert c.data == r.ptr and c.device == (2, 0) and c.dtype == (2, 32, 1)
    assert c.shape == [3, 4] and c.strides == [4, 1] and c.m.flags == 0  # writable
    c.delete()
    got = struct.unpack("<12f", parent.read(r.ptr, 48))
    assert list(got[1:]) == values[1:]
    with pytest.raises(BufferError, match="copy=True"):
        r.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="not"):
        r.__dlpack__(dl_device=(1, 0))
    with pytest.raises(ValueError, match="ambiguous"):
        r.__dlpack__(stream=0)
    assert r.live_exports == 0
    del r
    assert settled(parent, (0, 0)) == (0, 0)
    parent.stop(w)


@own_process
@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
@pytest.mark.parametrize("consumed", [True, False], ids=["consumed", "unconsumed"])
@pytest.mark.parametrize("object_first", [True, False], ids=["object-dropped-first", "capsule-first"])
def test_a_capsule_gives_the_block_back_exactly_once_whatever_goes_first(
    parent, request, versioned, consumed, object_first
):
    w = spawn(parent)
    data = pattern(1000)
    src = buffer_of(parent, data)
    base = live(parent)
    (r,) = parent.run(w, [poolipc.TensorRef(src.ptr, "uint8", [len(data)])])
    assert live(parent) == (base[0] + 1, base[1] + 1)
    cap = r.__dlpack__(stream=-1, max_version=(1, 0) if versioned else None)
    assert r.live_exports == 1
    c = Consumed(cap) if consumed else None
    if object_first:
        del r
        gc.collect()
        # The capsule (or the consumer's tensor) still holds the block.
        assert live(parent) == (base[0] + 1, base[1] + 1)
    if consumed:
        assert c.data is not None and parent.read(c.data, 4) == echoed(data)[:4]
        c.delete()  # the consumer lets go: the deleter runs once
        del cap  # a renamed capsule's destructor must not run the deleter again
    else:
        del cap  # the destructor of a capsule nobody took runs the deleter
    gc.collect()
    if not object_first:
        assert r.live_exports == 0
        assert live(parent) == (base[0] + 1, base[1] + 1)  # the object still holds it
        del r
    # Exactly back to the baseline: a second return would take results_out below it.
    assert settled(parent, base) == base
    time.sleep(0.05)
    assert live(parent) == base
    parent.stop(w)


@own_process
def test_two_exports_share_the_block_until_both_deleters_and_the_object_are_gone(parent, request):
    w = spawn(parent)
    src = buffer_of(parent, pattern(256))
    base = live(parent)
    (r,) = parent.run(w, [poolipc.TensorRef(src.ptr, "uint8", [256])])
    a = Consumed(r.__dlpack__(stream=-1))
    b = Consumed(r.__dlpack__(stream=-1, max_version=(1, 0)))
    assert a.data == b.data == r.ptr and r.live_exports == 2
    del r
    gc.collect()
    a.delete()
    assert live(parent) == (base[0] + 1, base[1] + 1)
    b.delete()
    assert settled(parent, base) == base


@own_process
def test_a_deleter_called_without_the_gil_from_another_thread_gives_the_block_back(parent, request):
    w = spawn(parent)
    src = buffer_of(parent, pattern(512))
    base = live(parent)
    results = [parent.run(w, [poolipc.TensorRef(src.ptr, "uint8", [512])])[0] for _ in range(8)]
    consumed = [Consumed(r.__dlpack__(stream=-1, max_version=(1, 0) if i % 2 else None))
                for i, r in enumerate(results)]
    del results
    gc.collect()
    assert live(parent) == (base[0] + 8, base[1] + 8)
    # ctypes releases the GIL around the call, so each deleter runs without it, here on
    # threads other than the one that made the capsule, all at once.
    start = threading.Barrier(len(consumed))

    def let_go(c):
        start.wait()
        c.delete()

    threads = [threading.Thread(target=let_go, args=(c,)) for c in consumed]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert settled(parent, base) == base
    parent.stop(w)


@own_process
def test_two_hundred_results_leave_the_arena_at_its_baseline(parent, request):
    w = spawn(parent)
    src = buffer_of(parent, pattern(64 * 1024))
    base = live(parent)
    held = []
    for i in range(200):
        n = 1 + (i * 977) % (64 * 1024)
        (r,) = parent.run(w, [poolipc.TensorRef(src.ptr, "uint8", [n])])
        assert r.rung == "arena"
        if i % 37 == 0:
            assert parent.read(r.ptr, n) == echoed(pattern(64 * 1024)[:n])
        held.append(r)
        if len(held) > 20:  # some held at once, most dropped soon
            held.pop(0)
    assert live(parent)[1] == base[1] + 20
    held.clear()
    del r
    assert settled(parent, base) == base
    s = parent.arena_stats()
    assert s["used"] == 0 and s["capacity"] <= ARENA_MAX
    parent.stop(w)


@own_process
def test_a_result_over_the_cap_is_arena_full_error_and_the_next_job_works(parent, request):
    w = spawn(parent)
    assert "7 of 7 canaries passed" in parent.canary_report(w)
    big = parent.alloc(OVER_CAP)
    base = live(parent)
    with pytest.raises(poolipc.ArenaFullError) as e:
        parent.run(w, [poolipc.TensorRef(big.ptr, "uint8", [OVER_CAP])])
    assert isinstance(e.value, MemoryError) and isinstance(e.value, poolipc.WorkerError)
    assert e.value.reason == "arena_full" and e.value.worker == w
    text = str(e.value)
    assert f"could not allocate {OVER_CAP} bytes" in text and f"grow to {ARENA_MAX} at most" in text, text
    assert live(parent) == base
    # the worker and the parent go on
    src = buffer_of(parent, pattern(100))
    (r,) = parent.run(w, [poolipc.TensorRef(src.ptr, "uint8", [100])])
    assert parent.read(r.ptr, 100) == echoed(pattern(100))
    del r
    assert settled(parent, base) == base
    parent.stop(w)


@own_process
def test_a_python_worker_carves_its_results_out_of_an_arena_slice_without_asking(parent, request):
    w = spawn(parent)
    data = pattern(300)
    src = buffer_of(parent, data)
    ref = poolipc.TensorRef(src.ptr, "uint8", [300])
    base = live(parent)
    before = parent.stats()
    parent.set_arena_slice_bytes(MIB)
    try:
        (a,) = parent.run(w, [ref])
        after = parent.stats()
        assert after["arena_slices_lent"] == before["arena_slices_lent"] + 1, after
        assert after["arena_results_carved"] == before["arena_results_carved"] + 1, after
        assert isinstance(a, poolipc.ArenaResult) and parent.last_result_rungs == ["arena"]
        assert parent.read(a.ptr, 300) == echoed(data)
        # A slice too small for the result: the worker asks as before, and still gets it.
        big = pattern(4096, seed=3)
        big_src = buffer_of(parent, big)
        parent.set_arena_slice_bytes(512)
        (b,) = parent.run(w, [poolipc.TensorRef(big_src.ptr, "uint8", [4096])])
        late = parent.stats()
        assert late["arena_slices_lent"] == after["arena_slices_lent"] + 1, late
        assert late["arena_results_carved"] == after["arena_results_carved"], late
        assert parent.read(b.ptr, 4096) == echoed(big)
    finally:
        parent.set_arena_slice_bytes(0)
    (c,) = parent.run(w, [ref])
    assert parent.stats()["arena_slices_lent"] == late["arena_slices_lent"]
    del a, b, c
    # The carved result's block and every slice's unused rest went back.
    assert settled(parent, base) == base
    parent.stop(w)


@own_process
def test_one_parent_runs_arena_jobs_and_pool_jobs_side_by_side(parent, request):
    w = spawn(parent)
    data = pattern(300)
    src = buffer_of(parent, data)
    ref = poolipc.TensorRef(src.ptr, "uint8", [300])
    base = live(parent)
    arena_before = parent.stats()["arena_results"]

    (a,) = parent.run(w, [ref])  # the parent's default: the arena
    assert isinstance(a, poolipc.ArenaResult) and parent.last_result_rungs == ["arena"]
    (p,) = parent.run(w, [ref], results="pool")
    assert isinstance(p, poolipc.DeviceBuffer) and p.shared
    assert parent.last_result_rungs == ["pool pointer"]

    made = []

    def alloc(dtype, shape, nbytes):
        b = parent.alloc(nbytes, dtype=dtype, shape=shape)
        made.append(b)
        return b

    (q,) = parent.run(w, [ref], alloc=alloc)
    assert q is made[0] and parent.last_result_rungs == ["pool pointer"]
    (b,) = parent.run(w, [ref], results="arena")
    assert isinstance(b, poolipc.ArenaResult)
    for x in (a, p, q, b):
        assert parent.read(x.ptr, 300) == echoed(data)
    assert parent.stats()["arena_results"] == arena_before + 2
    assert live(parent) == (base[0] + 2, base[1] + 2)
    with pytest.raises(ValueError, match="takes no alloc"):
        parent.run(w, [ref], results="arena", alloc=alloc)
    with pytest.raises(ValueError, match="not a result memory"):
        parent.run(w, [ref], results="host")
    del a, b, x
    assert settled(parent, base) == base
    parent.stop(w)


@own_process
def test_an_unwaited_job_gives_its_arena_results_back(parent, request):
    w = spawn(parent)
    src = buffer_of(parent, pattern(64))
    base = live(parent)
    h = parent.submit(w, [poolipc.TensorRef(src.ptr, "uint8", [64])])
    del h  # never waited for: the job runs to its end and its result goes back
    assert settled(parent, base) == base
    parent.stop(w)


@own_process
def test_the_arena_options_are_set_once_per_process_and_a_clash_is_a_value_error(parent, request):
    o = parent.options
    assert (o["results"], o["arena_bytes"], o["arena_max_bytes"]) == ("arena", ARENA_BYTES, ARENA_MAX)
    assert poolipc.Parent(0, results="arena", arena_max_bytes=ARENA_MAX).options == o
    with pytest.raises(ValueError, match=r'results="pool" \(the process\'s parent has "arena"\)'):
        poolipc.Parent(0, results="pool")
    with pytest.raises(ValueError, match=r"arena_max_bytes=1048576 \(the process's parent has 134217728\)"):
        poolipc.Parent(0, arena_max_bytes=MIB)
    with pytest.raises(ValueError, match="not a result memory"):
        poolipc.Parent(0, results="heap")
    with pytest.raises(ValueError, match="less than arena_bytes"):
        poolipc.Parent(0, arena_bytes=2 * MIB, arena_max_bytes=MIB)


@own_process
def test_empty_cache_gives_the_arenas_idle_chunks_back_and_the_next_result_grows_it_again(parent, request):
    w = spawn(parent)
    data = pattern(1 << 20)
    src = buffer_of(parent, data)
    (r,) = parent.run(w, [poolipc.TensorRef(src.ptr, "uint8", [len(data)])])
    # A live result keeps its chunk (other chunks, idle, may go).
    poolipc.empty_cache()
    s = parent.arena_stats()
    assert s["capacity"] > 0 and s["live_blocks"] == 1, s
    assert parent.read(r.ptr, r.nbytes) == echoed(data)
    del r
    assert settled(parent, (0, 0)) == (0, 0)
    capacity = parent.arena_stats()["capacity"]
    released = poolipc.empty_cache()
    s = parent.arena_stats()
    assert released >= capacity, (released, capacity)
    assert s["capacity"] == 0 and s["chunks"] == 0, s
    assert s["released_bytes"] >= capacity and s["released_chunks"] >= 1, s
    # The worker unmapped it and maps the next chunk, under a new index.
    (r,) = parent.run(w, [poolipc.TensorRef(src.ptr, "uint8", [len(data)])])
    assert parent.read(r.ptr, r.nbytes) == echoed(data)
    del r
    assert settled(parent, (0, 0)) == (0, 0)
    parent.stop(w)
