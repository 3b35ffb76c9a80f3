"""Does the pool's shareable FD keep freed exported allocations alive? (export_limbo.py
found an exported-then-freed allocation held, reserved 0, not reused, until the pool was
destroyed and its FD closed)

    python3 bench/probes/export_fd.py [GIB]
"""
import ctypes as C
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cu  # noqa: E402
from cu import CUdeviceptr, call, lib  # noqa: E402
from import_release import GIB, free_gib  # noqa: E402


def run(name, n, steps):
    pool = cu.make_pool(0)
    fds = []
    f0 = free_gib()
    p = CUdeviceptr()
    log = []
    destroyed = False
    for s in steps:
        if s == "fd":
            fds.append(cu.export_pool_fd(pool))
        elif s == "close":
            os.close(fds.pop())
        elif s == "alloc":
            call("cuMemAllocFromPoolAsync", C.byref(p), n * GIB, pool, None)
            call("cuMemsetD32_v2", p, 0x5A5A5A5A, n * GIB // 4)
            call("cuCtxSynchronize")
        elif s == "export":
            cu.export_ptr(p.value)
        elif s == "free":
            call("cuMemFreeAsync", p, None)
            call("cuCtxSynchronize")
        elif s == "trim":
            call("cuMemPoolTrimTo", pool, C.c_size_t(0))
        elif s == "destroy":
            call("cuMemPoolDestroy", pool)
            destroyed = True
        log.append(f"{s}:{f0 - free_gib():.2f}")
    for fd in fds:
        os.close(fd)
    if not destroyed:
        call("cuMemPoolDestroy", pool)
    print(f"{name:<52} [{' '.join(log)}]  end {f0 - free_gib():.2f}", flush=True)


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    cu.init_ctx(0)
    print(f"driver {cu.driver_version()}, {n} GiB; step:GiB held")
    run("FD open: alloc, export, free, trim", n, ["fd", "alloc", "export", "free", "trim"])
    run("FD open: alloc, export, free, trim, close FD, trim", n, ["fd", "alloc", "export", "free", "trim", "close", "trim"])
    run("FD closed first: fd, close, alloc, export, free, trim", n, ["fd", "close", "alloc", "export", "free", "trim"])
    run("FD open, alloc, export, free, destroy, close", n, ["fd", "alloc", "export", "free", "destroy", "close"])
    run("no export: fd, alloc, free, trim", n, ["fd", "alloc", "free", "trim"])
    run("FD closed, export, free, close 2nd FD later, trim", n, ["fd", "fd", "close", "alloc", "export", "free", "trim", "close", "trim"])


if __name__ == "__main__":
    main()
