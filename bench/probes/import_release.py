"""Does an importer's pool keep freed memory from the device?

A parent makes a POSIX-FD pool, allocates N GiB from it and exports the pointer; a child
imports the pool and the pointer, reads it, frees its import. The parent frees and trims.
Free device memory is printed after each step, then after the child trims its imported pool,
destroys it, and exits. A second part: the same pool, nothing lent, N GiB freed and trimmed
(is anything short at all?).

    python3 bench/probes/import_release.py [GIB]
"""
import ctypes as C
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cu  # noqa: E402
from cu import CUdeviceptr, call, lib  # noqa: E402

GIB = 1 << 30
RESERVED_MEM_CURRENT, USED_MEM_CURRENT = 5, 7
lib.cuMemAllocFromPoolAsync.argtypes = [C.POINTER(CUdeviceptr), C.c_size_t, C.c_void_p, C.c_void_p]
lib.cuMemPoolTrimTo.argtypes = [C.c_void_p, C.c_size_t]
lib.cuMemPoolGetAttribute.argtypes = [C.c_void_p, C.c_int, C.c_void_p]
lib.cuMemPoolDestroy.argtypes = [C.c_void_p]


def free_gib():
    f, t = C.c_size_t(), C.c_size_t()
    call("cuMemGetInfo_v2", C.byref(f), C.byref(t))
    return f.value / GIB


def pool_attr(pool, a):
    v = C.c_uint64()
    call("cuMemPoolGetAttribute", pool, a, C.byref(v))
    return v.value


def child():
    dev, _ = cu.init_ctx(0)
    fd = int(sys.argv[2])
    say = lambda s: (print(s, flush=True))  # noqa: E731
    say("ready")
    blob = bytes.fromhex(sys.stdin.readline().strip())
    pool, _ = cu.import_pool_fd(fd, dev)
    os.close(fd)  # as a poolipc worker does once the pool is imported
    ptr = cu.import_ptr(pool, blob)
    v = cu.read_u32(ptr)[0]
    say(f"imported {v:#x}")
    cmd = sys.stdin.readline().strip()
    assert cmd == "free", cmd
    call("cuMemFreeAsync", CUdeviceptr(ptr), None)
    call("cuCtxSynchronize")
    say("freed")
    for cmd in iter(sys.stdin.readline, ""):
        cmd = cmd.strip()
        if cmd == "trim":
            r = lib.cuMemPoolTrimTo(pool, 0)
            call("cuCtxSynchronize")
            say(f"trim -> {r}")
        elif cmd == "destroy":
            r = lib.cuMemPoolDestroy(pool)
            call("cuCtxSynchronize")
            say(f"destroy -> {r}")
        elif cmd == "exit":
            say("bye")
            return


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        return child()
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    dev, _ = cu.init_ctx(0)
    print(f"driver {cu.driver_version()}, {n} GiB")
    pool = cu.make_pool(dev)
    fd = cu.export_pool_fd(pool)
    f0 = free_gib()
    print(f"parent context up: {f0:.3f} GiB free")

    # Part 1: nothing lent.
    p = CUdeviceptr()
    call("cuMemAllocFromPoolAsync", C.byref(p), n * GIB, pool, None)
    call("cuMemsetD32_v2", p, 0x5A5A5A5A, n * GIB // 4)
    call("cuCtxSynchronize")
    call("cuMemFreeAsync", p, None)
    call("cuCtxSynchronize")
    print(f"alloc+free, no trim: {free_gib():.3f}  reserved {pool_attr(pool, RESERVED_MEM_CURRENT) / GIB:.3f} GiB")
    t0 = time.perf_counter()
    call("cuMemPoolTrimTo", pool, C.c_size_t(0))
    print(f"trimmed ({(time.perf_counter() - t0) * 1e3:.2f} ms): {free_gib():.3f}  short {f0 - free_gib():.4f} GiB, reserved {pool_attr(pool, RESERVED_MEM_CURRENT)}")

    # Part 2: lent to a child.
    c = subprocess.Popen([sys.executable, __file__, "child", str(fd)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, pass_fds=[fd])

    def ask(cmd=None):
        if cmd is not None:
            c.stdin.write(cmd + "\n")
            c.stdin.flush()
        return c.stdout.readline().strip()

    assert ask() == "ready"
    time.sleep(0.5)
    f1 = free_gib()
    print(f"child context up: {f1:.3f} (child context {f0 - f1:.3f} GiB)")
    call("cuMemAllocFromPoolAsync", C.byref(p), n * GIB, pool, None)
    call("cuMemsetD32_v2", p, 0x5A5A5A5A, n * GIB // 4)
    call("cuCtxSynchronize")
    blob = cu.export_ptr(p.value)
    print("child:", ask(blob.hex()))
    print(f"lent: {free_gib():.3f}")
    print("child:", ask("free"))
    call("cuMemFreeAsync", p, None)
    call("cuCtxSynchronize")
    call("cuMemPoolTrimTo", pool, C.c_size_t(0))
    a = free_gib()
    print(f"child freed its import, parent freed+trimmed: {a:.3f}  held {f1 - a:.3f} GiB, parent reserved {pool_attr(pool, RESERVED_MEM_CURRENT) / GIB:.3f}")
    print("child:", ask("trim"))
    call("cuMemPoolTrimTo", pool, C.c_size_t(0))
    a = free_gib()
    print(f"after the child trimmed its imported pool (+parent trim): {a:.3f}  held {f1 - a:.3f}")
    print("child:", ask("destroy"))
    call("cuMemPoolTrimTo", pool, C.c_size_t(0))
    a = free_gib()
    print(f"after the child destroyed its imported pool (+parent trim): {a:.3f}  held {f1 - a:.3f}")
    print("child:", ask("exit"))
    c.wait()
    time.sleep(0.5)
    call("cuMemPoolTrimTo", pool, C.c_size_t(0))
    a = free_gib()
    print(f"after the child exited (+parent trim): {a:.3f}  short of the parent's start {f0 - a:.4f}")


if __name__ == "__main__":
    main()
