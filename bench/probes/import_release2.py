"""Which order of frees gives an exported-and-imported pool allocation back to the device?
(follows import_release.py, which found 4 GiB held even after the importer exited)

Each variant: a fresh POSIX-FD pool, N GiB allocated, exported, and (unless said) imported by
a fresh child; then the frees and exits in the variant's order; then the parent trims the pool
and destroys it. Free memory is printed against the variant's start.

    python3 bench/probes/import_release2.py [GIB]
"""
import ctypes as C
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cu  # noqa: E402
from cu import CUdeviceptr, call, lib  # noqa: E402
from import_release import GIB, free_gib, pool_attr, RESERVED_MEM_CURRENT  # noqa: E402

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "import_release.py")


def variant(name, n, steps):
    dev = 0
    pool = cu.make_pool(dev)
    fd = cu.export_pool_fd(pool)
    c = None
    if "import" in steps:
        c = subprocess.Popen([sys.executable, CHILD, "child", str(fd)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, pass_fds=[fd])
        assert c.stdout.readline().strip() == "ready"
        time.sleep(0.3)
    f0 = free_gib()

    def ask(cmd):
        c.stdin.write(cmd + "\n")
        c.stdin.flush()
        return c.stdout.readline().strip()

    p = CUdeviceptr()
    call("cuMemAllocFromPoolAsync", C.byref(p), n * GIB, pool, None)
    call("cuMemsetD32_v2", p, 0x5A5A5A5A, n * GIB // 4)
    call("cuCtxSynchronize")
    log = []
    for s in steps:
        if s == "export":
            blob = cu.export_ptr(p.value)
        elif s == "import":
            log.append(ask(blob.hex()))
        elif s == "childfree":
            log.append(ask("free"))
        elif s == "childexit":
            ask("free") if "childfree" not in steps else None
            log.append(ask("exit"))
            c.wait()
            c = None
            time.sleep(0.3)
        elif s == "free":
            call("cuMemFreeAsync", p, None)
            call("cuCtxSynchronize")
        elif s == "trim":
            call("cuMemPoolTrimTo", pool, C.c_size_t(0))
        log.append(f"{s}:{f0 - free_gib():.2f}")
    held = f0 - free_gib()
    res = pool_attr(pool, RESERVED_MEM_CURRENT) / GIB
    r = lib.cuMemPoolDestroy(pool)
    time.sleep(0.2)
    after = f0 - free_gib()
    if c is not None:
        ask("exit")
        c.wait()
    time.sleep(0.3)
    final = f0 - free_gib()
    os.close(fd)
    print(f"{name:<44} held {held:6.3f} GiB (pool reserved {res:.3f}); after pool destroy ({r}) {after:6.3f}; after child gone {final:6.3f}  [{' '.join(log)}]", flush=True)


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    cu.init_ctx(0)
    print(f"driver {cu.driver_version()}, {n} GiB; 'held' = GiB less free than at the variant's start")
    variant("no export", n, ["free", "trim"])
    variant("export only", n, ["export", "free", "trim"])
    variant("import, child frees, parent frees, trim", n, ["export", "import", "childfree", "free", "trim"])
    variant("import, child frees+exits, parent frees, trim", n, ["export", "import", "childfree", "childexit", "free", "trim"])
    variant("import, parent frees, child frees, trim", n, ["export", "import", "free", "childfree", "trim"])
    variant("import, child frees, parent frees, child exits, trim", n, ["export", "import", "childfree", "free", "childexit", "trim"])
    variant("import, child frees, parent frees, trim, child exits, trim", n, ["export", "import", "childfree", "free", "trim", "childexit", "trim"])


if __name__ == "__main__":
    main()
