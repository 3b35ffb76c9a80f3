"""Does a killed process's kernel that never ends keep the GPU busy for the others?
(after the test suite, whose hang tests SIGKILL workers spinning in such a kernel, the demo's
rows took 13.7 ms where they take 0.6 ms, and the storm tests twice their time)

A child spins in a kernel that never ends; this process times a tiny piece of GPU work
(a 4-byte memset and a stream synchronize) before, while the child spins, and every quarter
second for 30 s after the child is SIGKILLed, with the compute processes `nvidia-smi` lists.

    python3 bench/probes/killed_kernel.py [SECONDS]      (prints one JSON line)
"""
import ctypes as C
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cu  # noqa: E402

# One thread spinning while the clock reads nonzero: poolipc's own hang kernel.
PTX = rb"""
.version 7.0
.target sm_50
.address_size 64
.visible .entry spin()
{
  .reg .u64 %rd<2>;
  .reg .pred %p<2>;
$spin:
  mov.u64 %rd1, %clock64;
  setp.ne.u64 %p1, %rd1, 0;
  @%p1 bra $spin;
  ret;
}
"""


def child():
    cu.init_ctx(0)
    mod = C.c_void_p()
    cu.call("cuModuleLoadData", C.byref(mod), C.c_char_p(PTX + b"\0"))
    fn = C.c_void_p()
    cu.call("cuModuleGetFunction", C.byref(fn), mod, b"spin")
    s = C.c_void_p()
    cu.call("cuStreamCreate", C.byref(s), 1)
    cu.lib.cuLaunchKernel.argtypes = [C.c_void_p] + [C.c_uint] * 6 + [C.c_uint, C.c_void_p, C.c_void_p, C.c_void_p]
    cu.call("cuLaunchKernel", fn, 1, 1, 1, 1, 1, 1, 0, s, None, None)
    print("spinning", flush=True)
    time.sleep(600)


def tiny_us(stream, buf, n):
    """Median microseconds of a 4-byte memset on `stream` and its synchronize."""
    times = []
    for _ in range(n):
        t = time.perf_counter_ns()
        cu.call("cuMemsetD32Async", buf, 7, 1, stream)
        cu.call("cuStreamSynchronize", stream)
        times.append((time.perf_counter_ns() - t) / 1000)
    return round(statistics.median(times), 1)


def gpu_processes():
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def parent(seconds):
    # Whatever computes on the GPU before this probe does (a process an earlier test left
    # behind, say) is in every figure below, "alone" too: listed, and said by the verdict.
    out = {"processes_before": gpu_processes()}
    cu.init_ctx(0)
    s = C.c_void_p()
    cu.call("cuStreamCreate", C.byref(s), 1)
    buf = cu.CUdeviceptr()
    cu.call("cuMemAlloc_v2", C.byref(buf), 4)
    out["alone_us"] = tiny_us(s, buf, 200)
    p = subprocess.Popen([sys.executable, __file__, "--child"], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "spinning"
    time.sleep(0.5)
    out["beside_spinner_us"] = tiny_us(s, buf, 20)
    out["processes_beside_spinner"] = gpu_processes()
    os.kill(p.pid, signal.SIGKILL)
    t0 = time.time()
    # Sampled while the kill takes effect: a child whose teardown waits on the GPU is seen
    # as not reaped yet, not as a probe that hangs.
    out["child_reaped_after_s"] = None
    samples = []
    while time.time() - t0 < seconds:
        if out["child_reaped_after_s"] is None and p.poll() is not None:
            out["child_reaped_after_s"] = round(time.time() - t0, 3)
        samples.append({"t": round(time.time() - t0, 2), "us": tiny_us(s, buf, 20),
                        "processes": gpu_processes()})
        time.sleep(0.25)
    out["after_kill"] = samples
    slow = [x["t"] for x in samples if x["us"] > 10 * max(out["alone_us"], 1.0)]
    out["slow_until_s"] = max(slow) if slow else 0.0
    out["verdict"] = ("the killed kernel slowed the GPU for the others until %.2f s after the kill" % out["slow_until_s"]
                      if slow else "the GPU was free for the others right after the kill")
    if out["processes_before"]:
        out["verdict"] += (" (not measured on an idle GPU: %d other compute process(es) before the probe)"
                           % len(out["processes_before"]))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child()
    else:
        parent(float(sys.argv[1]) if len(sys.argv) > 1 else 30.0)
