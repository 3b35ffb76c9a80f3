"""Probe (run on the H200, plain and under a private MPS daemon): what poolipc's parent sees
when a worker faults or is killed under MPS, whether the device attribute MPS_ENABLED tells a
client, whether PTX loads through the driver's JIT, and how the control daemon's quit behaves."""
import ctypes as C, json, os, signal, subprocess, sys, time
sys.path.insert(0, os.environ.get("CU_PY_DIR", os.path.dirname(os.path.abspath(__file__))))
import cu  # noqa: E402

PTX = b"""
.version 7.0
.target sm_50
.address_size 64
.visible .entry poolipc_fault(.param .u64 p)
{
  .reg .u64 %rd<2>;
  .reg .u32 %r<2>;
  ld.param.u64 %rd1, [p];
  mov.u32 %r1, 1;
  st.global.u32 [%rd1], %r1;
  ret;
}
"""

def attr(dev, a):
    v = C.c_int()
    r = cu.lib.cuDeviceGetAttribute(C.byref(v), a, dev)
    return v.value if r == 0 else f"err {r}"

def fault():
    dev, ctx = cu.init_ctx()
    mod = C.c_void_p()
    cu.call("cuModuleLoadData", C.byref(mod), C.c_char_p(PTX))
    fn = C.c_void_p()
    cu.call("cuModuleGetFunction", C.byref(fn), mod, b"poolipc_fault")
    p = C.c_uint64(16)
    args = (C.c_void_p * 1)(C.cast(C.pointer(p), C.c_void_p))
    cu.lib.cuLaunchKernel.argtypes = [C.c_void_p] + [C.c_uint] * 6 + [C.c_uint, C.c_void_p, C.c_void_p, C.c_void_p]
    r1 = cu.lib.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, None, args, None)
    r2 = cu.lib.cuCtxSynchronize()
    print(json.dumps({"child": "fault", "launch": r1, "sync": r2}), flush=True)
    time.sleep(float(os.environ.get("FAULT_LINGER", "0")))
    r3 = cu.lib.cuCtxSynchronize()
    print(json.dumps({"child": "fault", "sync_again": r3}), flush=True)

def sleeper():
    dev, ctx = cu.init_ctx()
    s = C.c_void_p(); cu.call("cuStreamCreate", C.byref(s), 1)
    print("ready", flush=True)
    time.sleep(60)

def calls(tag, pool, dev):
    """The parent's usual calls, each with its result code."""
    out = {}
    s = C.c_void_p(); out["stream_create"] = cu.lib.cuStreamCreate(C.byref(s), 1)
    ev = C.c_void_p(); out["event_create"] = cu.lib.cuEventCreate(C.byref(ev), 6)
    p = cu.CUdeviceptr(); out["alloc_async"] = cu.lib.cuMemAllocAsync(C.byref(p), 1 << 20, s)
    out["event_record"] = cu.lib.cuEventRecord(ev, s)
    out["event_query"] = cu.lib.cuEventQuery(ev)
    out["stream_sync"] = cu.lib.cuStreamSynchronize(s)
    b = cu.Blob64(); out["export"] = cu.lib.cuMemPoolExportPointer(C.byref(b), p) if p.value else None
    out["free_async"] = cu.lib.cuMemFreeAsync(p, s) if p.value else None
    out["ctx_sync"] = cu.lib.cuCtxSynchronize()
    return {tag: out}

def main():
    dev, ctx = cu.init_ctx()
    res = {"mps_env": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"), "attr_mps_enabled_133": attr(dev, 133)}
    pool = cu.make_pool(dev); cu.export_pool_fd(pool)
    cu.lib.cuDeviceSetMemPool(dev, pool)
    res.update(calls("before", pool, dev))
    # A bystander client that sleeps, then a child SIGKILLed mid-work.
    by = subprocess.Popen([sys.executable, __file__, "sleeper"], stdout=subprocess.PIPE, text=True)
    by.stdout.readline()
    k = subprocess.Popen([sys.executable, __file__, "sleeper"], stdout=subprocess.PIPE, text=True)
    k.stdout.readline(); k.send_signal(signal.SIGKILL); k.wait()
    res.update(calls("after_sigkill", pool, dev))
    t = time.time()
    f = subprocess.run([sys.executable, __file__, "fault"], capture_output=True, text=True, timeout=120)
    res["fault_child"] = {"rc": f.returncode, "out": f.stdout.strip()[-300:], "err": f.stderr.strip()[-300:], "s": round(time.time() - t, 2)}
    for i in range(3):
        res.update(calls(f"after_fault_{i}", pool, dev))
        time.sleep(0.5)
    by.kill()
    # A non-MPS child while we are an MPS client: pool IPC across the boundary.
    env = dict(os.environ); env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
    env["CUDA_MPS_PIPE_DIRECTORY"] = "/nonexistent-poolipc"
    c = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, %r); import cu; d,_=cu.init_ctx(); print(cu.lib.cuDeviceGetAttribute)" % os.path.dirname(cu.__file__)], env=env, capture_output=True, text=True, timeout=60)
    res["non_mps_child"] = {"rc": c.returncode, "err": c.stderr.strip()[-200:]}
    print(json.dumps(res, default=str), flush=True)

if __name__ == "__main__":
    {"fault": fault, "sleeper": sleeper}.get(sys.argv[1] if len(sys.argv) > 1 else "", main)()
