"""Where does an exported pool allocation go when it is freed and the pool trimmed? (what
import_release2.py found: export only, free, trim -> the memory is not back, reserved reads 0,
even after cuMemPoolDestroy)

    python3 bench/probes/export_limbo.py [GIB]
"""
import ctypes as C
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cu  # noqa: E402
from cu import CUdeviceptr, call, lib  # noqa: E402
from import_release import GIB, free_gib, pool_attr, RESERVED_MEM_CURRENT  # noqa: E402


def run(name, n, steps):
    pool = cu.make_pool(0)
    fd = cu.export_pool_fd(pool)
    f0 = free_gib()
    ptrs = []
    log = []
    for s in steps:
        if s == "alloc":
            p = CUdeviceptr()
            call("cuMemAllocFromPoolAsync", C.byref(p), n * GIB, pool, None)
            call("cuMemsetD32_v2", p, 0x5A5A5A5A, n * GIB // 4)
            call("cuCtxSynchronize")
            ptrs.append(p.value)
            log.append(f"alloc@{p.value:#x}")
        elif s == "export":
            cu.export_ptr(ptrs[-1])
        elif s == "free":
            call("cuMemFreeAsync", CUdeviceptr(ptrs.pop()), None)
            call("cuCtxSynchronize")
        elif s == "trim":
            call("cuMemPoolTrimTo", pool, C.c_size_t(0))
        elif s == "sleep":
            time.sleep(3)
        elif s == "sync":
            call("cuCtxSynchronize")
        log.append(f"{s}:{f0 - free_gib():.2f}/{pool_attr(pool, RESERVED_MEM_CURRENT) / GIB:.2f}")
    for p in ptrs:
        call("cuMemFreeAsync", CUdeviceptr(p), None)
    call("cuCtxSynchronize")
    call("cuMemPoolTrimTo", pool, C.c_size_t(0))
    lib.cuMemPoolDestroy(pool)
    os.close(fd)
    print(f"{name:<40} [{' '.join(log)}]  end: held {f0 - free_gib():.3f}", flush=True)


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    cu.init_ctx(0)
    g0 = free_gib()
    print(f"driver {cu.driver_version()}, {n} GiB; step:held/reserved GiB")
    run("export, free, sleep, trim, sleep", n, ["alloc", "export", "free", "sleep", "trim", "sleep"])
    run("export, free, no trim, alloc again", n, ["alloc", "export", "free", "alloc", "free", "trim"])
    run("export, free, trim, alloc again", n, ["alloc", "export", "free", "trim", "alloc", "free", "trim"])
    run("export twice over: a+e, f, t, a+e, f, t", n, ["alloc", "export", "free", "trim", "alloc", "export", "free", "trim"])
    run("export, free, alloc (reuse), free, trim", n, ["alloc", "export", "free", "alloc", "export", "free", "trim"])
    print(f"process total: {g0 - free_gib():.3f} GiB less free than at the start")


if __name__ == "__main__":
    main()
