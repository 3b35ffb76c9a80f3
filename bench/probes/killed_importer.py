"""When does a pool give back memory whose importer was SIGKILLed holding it?

A parent makes a POSIX-FD pool and allocates N chunks of C MiB from it, each exported; a child
imports the pool and every chunk and waits. Then, for each way the child goes (SIGKILLed
holding its imports; freeing them and exiting), the parent frees its allocations and trims the
pool to 0 every 100 ms for 10 s, printing the pool's reserved bytes and the device's free
memory at each change: how long after the child is reaped the reserved figure drops, and
whether the device sees the memory again.

    python3 bench/probes/killed_importer.py [N] [CHUNK_MIB]
"""
import ctypes as C
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cu  # noqa: E402
from cu import CUdeviceptr, call, lib  # noqa: E402
from import_release import GIB, RESERVED_MEM_CURRENT, free_gib, pool_attr  # noqa: E402

MIB = 1 << 20
RELEASE_THRESHOLD = 4
lib.cuMemPoolSetAttribute.argtypes = [C.c_void_p, C.c_int, C.c_void_p]


def child():
    dev, _ = cu.init_ctx(0)
    fd = int(sys.argv[2])
    pool, _ = cu.import_pool_fd(fd, dev)
    os.close(fd)
    ptrs = []
    for line in iter(sys.stdin.readline, ""):
        line = line.strip()
        if line == "done":
            break
        ptrs.append(cu.import_ptr(pool, bytes.fromhex(line)))
    cu.read_u32(ptrs[-1])
    print("imported", len(ptrs), flush=True)
    cmd = sys.stdin.readline().strip()
    if cmd == "free-exit":
        for p in ptrs:
            call("cuMemFreeAsync", CUdeviceptr(p), None)
        call("cuCtxSynchronize")
        print("freed", flush=True)
        return
    time.sleep(3600)


def one(how, pool, fd, n, chunk):
    f0 = free_gib()
    ptrs = []
    for _ in range(n):
        p = CUdeviceptr()
        call("cuMemAllocFromPoolAsync", C.byref(p), chunk, pool, None)
        ptrs.append(p.value)
    call("cuMemsetD32_v2", CUdeviceptr(ptrs[-1]), 0x5A5A5A5A, chunk // 4)
    call("cuCtxSynchronize")
    c = subprocess.Popen([sys.executable, __file__, "child", str(fd)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, pass_fds=[fd])
    for p in ptrs:
        c.stdin.write(cu.export_ptr(p).hex() + "\n")
    c.stdin.write("done\n")
    c.stdin.flush()
    got = c.stdout.readline().strip()
    held = f0 - free_gib()
    print(f"{how}: {got}; {held:.2f} GiB held, reserved {pool_attr(pool, RESERVED_MEM_CURRENT) / GIB:.2f} GiB", flush=True)
    t0 = time.perf_counter()
    if how == "killed":
        c.send_signal(signal.SIGKILL)
        c.wait()
        print(f"  reaped after {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
    else:
        c.stdin.write("free-exit\n")
        c.stdin.flush()
        c.stdout.readline()
        c.wait()
    for p in ptrs:
        call("cuMemFreeAsync", CUdeviceptr(p), None)
    call("cuCtxSynchronize")
    t0 = time.perf_counter()
    last = None
    while time.perf_counter() - t0 < 10:
        call("cuMemPoolTrimTo", pool, C.c_size_t(0))
        now = (round(pool_attr(pool, RESERVED_MEM_CURRENT) / GIB, 2), round(f0 - free_gib(), 2))
        if now != last:
            print(f"  +{(time.perf_counter() - t0) * 1e3:7.1f} ms after the frees: reserved {now[0]:.2f} GiB, device short {now[1]:.2f} GiB", flush=True)
            last = now
        time.sleep(0.1)
    print(f"  after 10 s: reserved {last[0]:.2f} GiB, device short {last[1]:.2f} GiB", flush=True)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        return child()
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    chunk = (int(sys.argv[2]) if len(sys.argv) > 2 else 32) * MIB
    dev, _ = cu.init_ctx(0)
    print(f"driver {cu.driver_version()}, {n} x {chunk // MIB} MiB")
    for how in ("killed", "freed-and-exited"):
        pool = cu.make_pool(dev)
        # As poolipc's pool: freed memory stays the pool's until a trim.
        keep = C.c_uint64(2**64 - 1)
        call("cuMemPoolSetAttribute", pool, RELEASE_THRESHOLD, C.byref(keep))
        fd = cu.export_pool_fd(pool)
        one(how, pool, fd, n, chunk)
        lib.cuMemPoolDestroy(pool)
        os.close(fd)
        time.sleep(0.5)
        print(f"  pool destroyed: {free_gib():.2f} GiB free", flush=True)


if __name__ == "__main__":
    main()
