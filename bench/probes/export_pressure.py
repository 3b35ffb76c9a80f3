"""Is an exported-then-freed pool allocation reclaimed under memory pressure?
16 GiB allocated, exported and freed 12 times (192 GiB, more than the card); then another
process asks cuMemAlloc for what the parent does not use.

    python3 bench/probes/export_pressure.py [GIB] [ROUNDS]
"""
import ctypes as C
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cu  # noqa: E402
from cu import CUdeviceptr, call, lib  # noqa: E402
from import_release import GIB, free_gib, pool_attr, RESERVED_MEM_CURRENT  # noqa: E402


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    cu.init_ctx(0)
    pool = cu.make_pool(0)
    fd = cu.export_pool_fd(pool)
    f0 = free_gib()
    print(f"driver {cu.driver_version()}: {f0:.2f} GiB free at start")
    p = CUdeviceptr()
    for i in range(rounds):
        r = lib.cuMemAllocFromPoolAsync(C.byref(p), n * GIB, pool, None)
        if r != 0:
            print(f"round {i}: alloc refused ({r}); held {f0 - free_gib():.2f}")
            break
        call("cuMemsetD32_v2", p, i, n * GIB // 4)
        cu.export_ptr(p.value)
        call("cuMemFreeAsync", p, None)
        call("cuCtxSynchronize")
        print(f"round {i}: at {p.value:#x}; held after free {f0 - free_gib():.2f} GiB, reserved {pool_attr(pool, RESERVED_MEM_CURRENT) / GIB:.2f}", flush=True)
    call("cuMemPoolTrimTo", pool, C.c_size_t(0))
    want = int((f0 - 4) * GIB)
    code = ("import ctypes as C; l=C.CDLL('libcuda.so.1'); l.cuInit(0); d=C.c_int(); l.cuDeviceGet(C.byref(d),0);"
            "c=C.c_void_p(); l.cuDevicePrimaryCtxRetain(C.byref(c),d); l.cuCtxSetCurrent(c); p=C.c_uint64();"
            f"l.cuMemAlloc_v2.argtypes=[C.POINTER(C.c_uint64), C.c_size_t]; print(l.cuMemAlloc_v2(C.byref(p), {want}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
    print(f"another process asks cuMemAlloc for {want / GIB:.1f} GiB: result {out} (0 = ok); parent holds {f0 - free_gib():.2f}")
    call("cuMemPoolDestroy", pool)
    os.close(fd)
    print(f"pool destroyed, FD closed: held {f0 - free_gib():.2f}")


if __name__ == "__main__":
    main()
