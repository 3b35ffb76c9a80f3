"""A typed use of the binding's whole public surface, for `mypy --strict` (test_sim.py runs it):
not run, only checked. `assert_type` pins what each call gives, so a stub that drifts to `Any`
or to another type fails the check."""

from __future__ import annotations

import sys
from typing import Any

from typing_extensions import assert_type

import poolipc
from poolipc import _native


def parent_side(script: str) -> None:
    info = poolipc.install_pool(0, stop_timeout=2.0)
    assert_type(info, poolipc.InstallInfo)
    assert_type(info["effective"], bool)
    assert_type(info["reason"], str | None)
    stats = poolipc.memory_stats()
    assert_type(stats, poolipc.MemoryStats)
    assert_type(stats["used_high"], int)
    poolipc.reset_peak_memory_stats()

    parent = poolipc.Parent(0, handoff_timeout=30.0)
    assert_type(parent.driver, str)
    assert_type(parent.simulated, bool)
    assert_type(parent.options, poolipc.ParentOptions)
    assert_type(parent.options["stop_timeout"], float)
    assert_type(parent.stats(), poolipc.ParentStats)

    w = parent.spawn([sys.executable, script], {"POOLIPC_DEVICE": "parent"})
    assert_type(w, int)
    assert_type(parent.spawn_python(script, "--flag"), int)
    assert_type(parent.pid(w), int | None)
    assert_type(parent.workers(), list[int])
    assert_type(parent.canary_report(w), str | None)

    buf = parent.alloc(16, dtype="float32", shape=[4])
    kind: poolipc.DType = buf.dtype
    assert kind == poolipc.DType("torch.float32") and isinstance(kind, str)
    assert_type(buf, poolipc.DeviceBuffer)
    assert_type(buf.ptr, int)
    assert_type(buf.shape, tuple[int, ...])
    parent.write(buf.ptr, b"\0" * 16)
    assert_type(parent.read(buf.ptr, 16), bytes)
    parent.synchronize(0)

    ref = poolipc.TensorRef(buf.ptr, "float32", [2, 2], strides=[2, 1])
    assert_type(ref.strides, tuple[int, ...] | None)

    def alloc(dtype: str, shape: tuple[int, ...], nbytes: int) -> poolipc.DeviceBuffer:
        return parent.alloc(nbytes, dtype=dtype, shape=shape)

    results = parent.run(w, [ref], stream=0, alloc=alloc)
    assert_type(results, list[Any])
    handle = parent.submit(w, [ref])
    assert_type(handle, poolipc.JobHandle)
    assert_type(handle.done, bool)
    assert_type(handle.input_rungs, list[str] | None)
    try:
        handle.wait(timeout=1.0)
    except poolipc.WorkerError as e:
        assert_type(e.message, str)
        assert_type(e.worker, int | None)
    except poolipc.JobFailedError as e:
        assert_type(e.reason, str | None)
    except poolipc.UnknownWorkerError as e:
        assert_type(e.worker, int)
    assert_type(parent.stop(w), int | None)
    buf.free()


def arena_side(script: str) -> None:
    poolipc.install_pool(0, results="arena", arena_bytes=1 << 26, arena_max_bytes=1 << 30)
    parent = poolipc.Parent(0, results="arena", arena_max_bytes=1 << 30)
    assert_type(parent.options["results"], str)
    assert_type(parent.options["arena_max_bytes"], int | None)
    assert_type(parent.stats()["arena_results"], int)
    s = parent.arena_stats()
    assert_type(s, poolipc.ArenaStats)
    assert_type(s["live_blocks"], int)
    assert_type(s["results_out"], int)
    assert_type(s["max_bytes"], int | None)
    w = parent.spawn_python(script)
    src = parent.alloc(16)
    ref = poolipc.TensorRef(src.ptr, "uint8", [16])
    try:
        (r,) = parent.run(w, [ref], results="arena")
    except poolipc.ArenaFullError as e:
        assert_type(e.reason, str | None)
        assert_type(e.message, str)
        return
    if isinstance(r, poolipc.ArenaResult):
        assert_type(r.rung, str)
        assert_type(r.nbytes, int)
        assert_type(r.shape, tuple[int, ...])
        assert_type(r.live_exports, int)
        assert_type(r.__dlpack_device__(), tuple[int, int])
        assert_type(r.__cuda_array_interface__, dict[str, Any])
        r.__dlpack__(stream=-1, max_version=(1, 0))
    pool = parent.submit(w, [ref], results="pool").wait()
    assert_type(pool, list[Any])


def worker_side() -> None:
    worker = poolipc.Worker("any:0")
    assert_type(worker.device, int)
    assert_type(worker.stream, int)
    for job in worker:
        assert_type(job, poolipc.Job)
        with job as j:
            assert_type(j, poolipc.Job)
            (x,) = j.inputs
            assert_type(x, poolipc.View)
            assert_type(x.shape, tuple[int, ...])
            assert_type(x.read_only, bool)
            assert_type(x.__dlpack_device__(), tuple[int, int])
            x.__dlpack__(stream=1, max_version=(1, 0))
            (out,) = j.request_results([(x.dtype, x.shape)])
            out.write_bytes(x.read_bytes())
            assert_type(j.live_exports, int)
    nxt = worker.next_job()
    assert_type(nxt, poolipc.Job | None)
    worker.close()


def native_side() -> None:
    assert_type(_native.DRIVER_ENV, str)
    assert_type(_native.is_installed(), bool)
    p = _native.NativeParent(0)
    h = p.submit(1, [poolipc.TensorRef(0x1000, "float32", [4])])
    assert_type(h, _native.NativeJobHandle)
    results, rungs = h.wait(None)
    assert_type(rungs, list[str])
    for ptr, nbytes, dtype, shape, rung, owner in results:
        assert_type(ptr, int)
        assert_type(shape, list[int])
    nw = _native.NativeWorker(None, any=False)
    assert_type(nw.next_job(), _native.Job | None)


def mps_side() -> None:
    status = poolipc.mps_status()
    assert_type(status, poolipc.MpsStatus)
    assert_type(status["daemon_reachable"], bool)
    assert_type(status["control_binary"], str | None)
    try:
        pipe = poolipc.start_mps(accept_shared_gpu_faults=True)
        assert_type(pipe, str)
    except poolipc.MpsError as e:
        assert_type(e, poolipc.MpsError)
    try:
        pass
    except poolipc.ContextLostError as e:
        assert_type(e, poolipc.ContextLostError)


def listener_and_leases(parent: poolipc.Parent) -> None:
    listener = parent.listen()
    assert_type(listener, poolipc.Listener)
    assert_type(listener.path, str)
    assert_type(listener.env(), dict[str, str])
    assert_type(listener.accept(timeout=1.0), int)
    assert_type(listener.refused, list[str])
    listener.close()
    worker = poolipc.Worker.connect(listener.path, device="parent")
    assert_type(worker, poolipc.Worker)
    worker.auto_take()
    job = worker.take(None, timeout=1.0)
    assert_type(job, poolipc.Job | None)
    if job is not None:
        hold = job.lease()
        assert_type(hold, poolipc.LeaseHold)
        assert_type(hold.job, int | None)
        hold.release()
    assert_type(worker.next_job(concurrent=True), poolipc.Job | None)
    try:
        poolipc.Worker.connect("/nowhere")
    except poolipc.ConnectError as e:
        assert_type(e, poolipc.ConnectError)


def pyisolate_side(parent: poolipc.Parent) -> None:
    import poolipc.pyisolate as pp

    channel = pp.HostChannel(parent, accept_timeout=5.0)
    assert_type(channel.env(), dict[str, str])
    assert_type(channel.connect(1.0), int)
    assert_type(channel.worker, int | None)
    assert_type(channel.leases_out(), int)
    with channel.sending() as c:
        assert_type(c, pp.HostChannel)
    channel.close()
    pp.register(None, child=False)
    assert_type(pp.child_channel(), pp.ChildChannel | None)
    assert_type(pp.PoolipcAdapter().identifier, str)
    assert pp.LENT == "PoolipcTensor" and pp.RETURNED == "PoolipcResult"
