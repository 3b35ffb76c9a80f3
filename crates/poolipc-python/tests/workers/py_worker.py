"""A Python worker for the test suites, torch-free: POOLIPC_TEST_MODE picks its behaviour.
With POOLIPC_CONNECT set (a parent's listener.env()) it connects by path instead of taking
the socket its parent's spawn left.

echo              a result per input, same dtype and shape, holding the input's elements
                  (gathered by strides), its first 32-bit word replaced by 0xEC40_0000 | i
probe             like echo, and writes a JSON report (POOLIPC_TEST_REPORT) of what the views
                  say: layout, __cuda_array_interface__, the DLPack capsules' structure read
                  with ctypes, and what every use after the job raised
fail              raises inside the job: the parent's run() must raise with the text
fail-escape       like fail, with terminal escapes, a carriage return and a forged log line
                  in the text
die-after-import  killed (SIGKILL) after the inputs arrived
die-after-grant   killed after the results were granted
bad-dtype         asks for a result of a dtype that does not exist, reports the error
gate              like echo, but first reports {"entered": pid, "job": id} and waits until the
                  file POOLIPC_TEST_GATE exists (so a test sees two workers hold a job at once
                  without timing anything); fails the job if the gate stays shut for 60 s
linger            like echo, but ignores the parent's goodbye: it neither exits nor dies of
                  SIGTERM, so only a kill ends it
typed-errors      asks for a result too large to count in bytes, then finishes the job from two
                  threads at once; reports what each raised (or "ok"), and echoes nothing
too-many-results  asks for 5000 results in one request, reports what that raised
                  ({"too_many": ...}), and fails the job with it
environ           reports the names of its environment variables ({"environ": [...]}), then
                  echoes
gate-write        like gate, then like write-inputs
write-inputs      writes 0xAB bytes at the start of every input view and reports, per input,
                  its rung, read_only and what the write raised; then echoes
drop-unfinished   echoes, then drops the job without finishing it and at once asks for the
                  next: the finish the drop posts must be carried out before that call waits
any-thread        takes, echoes and finishes each job on a new thread (none of them the one
                  that made the worker)
heartbeat         computes for POOLIPC_TEST_COMPUTE_S seconds (default 3) calling
                  job.heartbeat() every 0.2 s, then echoes
silent            like heartbeat, without the heartbeats
"""

import ctypes
import json
import os
import signal
import struct
import sys
import threading
import time

import poolipc

MODE = os.environ.get("POOLIPC_TEST_MODE", "echo")
REPORT = os.environ.get("POOLIPC_TEST_REPORT")
GATE = os.environ.get("POOLIPC_TEST_GATE")


def say(obj):
    """Appends one JSON line to the report (when there is one)."""
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(obj) + "\n")


def marker(i):
    return 0xEC400000 | (i & 0xFFFF)


def gather(view):
    """The view's elements in row-major order, as bytes (read through the binding)."""
    raw = view.read_bytes()
    elem = len(struct.pack("<" + {"float32": "f", "int64": "q", "bfloat16": "H", "uint8": "B",
                                  "float16": "e", "int32": "i", "float64": "d"}[view.dtype], 0))
    shape, strides = view.shape, view.strides
    total = 1
    for d in shape:
        total *= d
    # Row-major already: the bytes as they are (a 128 MiB input gathered element by element
    # takes Python half a minute, close to the handoff deadline).
    row_major, step = [], 1
    for d in reversed(shape):
        row_major.insert(0, step)
        step *= d
    if list(strides) == row_major:
        return bytes(raw[:total * elem])
    out = bytearray()
    idx = [0] * len(shape)
    for _ in range(total):
        off = sum(i * s for i, s in zip(idx, strides)) * elem
        out += raw[off:off + elem]
        for k in reversed(range(len(shape))):
            idx[k] += 1
            if idx[k] < shape[k]:
                break
            idx[k] = 0
    return bytes(out)


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


def read_capsule(cap, versioned):
    """Consume the capsule the way torch does: read the struct, rename, call the deleter."""
    name = api.PyCapsule_GetName(cap).decode()
    ptr = api.PyCapsule_GetPointer(cap, name.encode())
    kind = DLManagedTensorVersioned if versioned else DLManagedTensor
    m = ctypes.cast(ptr, ctypes.POINTER(kind)).contents
    t = m.dl_tensor
    info = {
        "name": name,
        "data": t.data,
        "device": [t.device.device_type, t.device.device_id],
        "ndim": t.ndim,
        "dtype": [t.dtype.code, t.dtype.bits, t.dtype.lanes],
        "shape": [t.shape[i] for i in range(t.ndim)],
        "strides": [t.strides[i] for i in range(t.ndim)],
        "byte_offset": t.byte_offset,
    }
    if versioned:
        info["version"] = [m.major, m.minor]
        info["flags"] = m.flags
    return info, m, ptr


def raises(f):
    try:
        f()
    except BaseException as e:  # noqa: BLE001 - the report names whatever it was
        return type(e).__name__ + ": " + str(e)
    return None


def echo(job):
    views = job.inputs
    if not views:
        return
    outs = job.request_results([(v.dtype, list(v.shape)) for v in views])
    if MODE == "die-after-grant":
        os.kill(os.getpid(), signal.SIGKILL)
    for i, (v, out) in enumerate(zip(views, outs)):
        data = bytearray(gather(v))
        if len(data) >= 4:
            data[0:4] = struct.pack("<I", marker(i))
        out.write_bytes(bytes(data))


def probe(job):
    rep = {"job_stream": job.stream, "inputs": []}
    keep = []
    for v in job.inputs:
        r = {"ptr": v.ptr, "dtype": v.dtype, "shape": list(v.shape), "strides": list(v.strides),
             "nbytes": v.nbytes, "rung": v.rung, "dlpack_device": list(v.__dlpack_device__()),
             "repr": repr(v), "read_only": v.read_only}
        if v.read_only:
            r["write_error"] = raises(lambda: v.write_bytes(b"\0" * min(4, v.nbytes)))
        try:
            cai = v.__cuda_array_interface__
            r["cai"] = {k: (list(x) if isinstance(x, tuple) else x) for k, x in cai.items()}
        except AttributeError as e:
            r["cai_error"] = str(e)
        # An unconsumed capsule: its destructor must free the tensor (live_exports back).
        before = job.live_exports
        cap = v.__dlpack__(stream=-1)
        r["live_with_capsule"] = job.live_exports - before
        del cap
        r["live_after_drop"] = job.live_exports - before
        # Consumed capsules, legacy and versioned, kept alive past the job's end.
        for versioned in (False, True):
            try:
                cap = v.__dlpack__(stream=None, max_version=(1, 0) if versioned else None)
            except BufferError as e:
                r["dlpack_error"] = str(e)
                break
            info, m, ptr = read_capsule(cap, versioned)
            api.PyCapsule_SetName(cap, b"used_dltensor_versioned" if versioned else b"used_dltensor")
            del cap
            keep.append((m, ptr, versioned))
            r["capsule_versioned" if versioned else "capsule"] = info
        r["live_consumed"] = job.live_exports
        rep["inputs"].append(r)
    echo(job)
    rep["results"] = [{"ptr": o.ptr, "dtype": o.dtype, "shape": list(o.shape), "is_result": o.is_result,
                       "cai_strides": list(o.__cuda_array_interface__["strides"])
                       if o.dtype != "bfloat16" else None}
                      for o in job.results]
    views = job.inputs + job.results
    job.finish()
    rep["after"] = {
        "ptr": raises(lambda: views[0].ptr),
        "read_bytes": raises(lambda: views[0].read_bytes()),
        "dlpack": raises(lambda: views[0].__dlpack__()),
        "cai": raises(lambda: views[0].__cuda_array_interface__),
        "result_ptr": raises(lambda: views[-1].ptr) if job.results else None,
        "finish_again": raises(job.finish),
        "request_again": raises(lambda: job.request_results([("float32", [1])])),
        "valid": views[0].valid,
        "open": job.open,
        "live_exports_before_deleters": job.live_exports,
    }
    # The consumer lets go: the deleters run (with the job already ended).
    for m, ptr, versioned in keep:
        kind = DLManagedTensorVersioned if versioned else DLManagedTensor
        m.deleter(ctypes.cast(ptr, ctypes.POINTER(kind)))
    rep["after"]["live_exports_after_deleters"] = job.live_exports
    with open(REPORT, "a") as f:
        f.write(json.dumps(rep) + "\n")


def main():
    # Started by someone else (a listener's env): connect by path; spawned: the inherited socket.
    worker = poolipc.Worker.connect() if os.environ.get(poolipc.CONNECT_ENV) else poolipc.Worker()
    with open(REPORT, "a") if REPORT else open(os.devnull, "w") as f:
        f.write(json.dumps({"started": True, "simulated": worker.simulated, "stream": worker.stream}) + "\n")
    if MODE == "environ":
        say({"environ": sorted(os.environ)})
    if MODE == "drop-unfinished":
        while (job := worker.next_job()) is not None:
            echo(job)
            del job  # the last reference: its drop posts the finish
        worker.close()
        return
    if MODE == "any-thread":
        taken = []

        def one():
            job = worker.next_job()
            taken.append(job is not None)
            if job is not None:
                with job:
                    echo(job)

        while not taken or taken[-1]:
            t = threading.Thread(target=one)
            t.start()
            t.join()
        worker.close()
        return
    for job in worker:
        if MODE == "die-after-import":
            os.kill(os.getpid(), signal.SIGKILL)
        if MODE in ("gate", "gate-write"):
            say({"entered": os.getpid(), "job": job.id})
            deadline = time.monotonic() + 60
            while not os.path.exists(GATE):
                if time.monotonic() > deadline:
                    job.fail("the gate stayed shut for 60 s")
                    break
                time.sleep(0.01)
            if not job.open:
                continue
        if MODE in ("write-inputs", "gate-write"):
            rep = []
            for v in job.inputs:
                err = raises(lambda: v.write_bytes(b"\xab" * min(4, v.nbytes)))
                rep.append({"rung": v.rung, "read_only": v.read_only, "write_error": err})
            say({"writes": rep})
        if MODE == "probe":
            probe(job)
            continue
        if MODE in ("heartbeat", "silent"):
            until = time.monotonic() + float(os.environ.get("POOLIPC_TEST_COMPUTE_S", "3"))
            while time.monotonic() < until:
                time.sleep(0.2)
                if MODE == "heartbeat":
                    job.heartbeat()
        if MODE == "typed-errors":
            too_large = raises(lambda: job.request_results([("float32", [2**40, 2**40])]))
            outcomes = []
            start = threading.Barrier(2)

            def finish():
                start.wait()
                outcomes.append(raises(job.finish) or "ok")

            threads = [threading.Thread(target=finish) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            say({"too_large": too_large, "finish_twice": sorted(o.split(":")[0] for o in outcomes)})
            continue
        if MODE == "too-many-results":
            err = raises(lambda: job.request_results([("uint8", [1])] * 5000))
            say({"too_many": err})
            job.fail(f"too many results: {err}")
            continue
        if MODE == "bad-dtype":
            err = raises(lambda: job.request_results([("float33", [4])]))
            job.fail(f"bad dtype said: {err}")
            continue
        try:
            with job:  # an exception inside fails the job with its text, then propagates
                if MODE == "fail":
                    raise ValueError("the worker failed on purpose")
                if MODE == "fail-escape":
                    raise ValueError("\x1b[2J\x1b[31mred\x07 text\rover\nERROR poolipc: forged")
                echo(job)
        except (ValueError, poolipc.PoolipcError) as e:
            if not MODE.startswith("fail") and not isinstance(e, poolipc.PoolipcError):
                raise
            # the job failed (on purpose, or the parent refused its results): the `with`
            # reported it to the parent, and the worker goes on to the next job
    worker.close()
    if MODE == "linger":
        # The parent said goodbye; a worker that ignores it stays until it is killed.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        say({"lingering": os.getpid()})
        time.sleep(600)


if __name__ == "__main__":
    sys.exit(main())
