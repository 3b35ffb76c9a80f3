"""Does an importer's pool handle keep a destroyed pool's exported memory? (a pool
retired on empty_cache gives its exported allocations' memory back only if the workers'
imported handles do not hold it)

    python3 bench/probes/export_destroy.py [GIB]
"""
import ctypes as C
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cu  # noqa: E402
from cu import CUdeviceptr, call  # noqa: E402
from import_release import GIB, free_gib  # noqa: E402

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "import_release.py")


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    cu.init_ctx(0)
    pool = cu.make_pool(0)
    fd = cu.export_pool_fd(pool)
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
    print("child:", ask(cu.export_ptr(p.value).hex()), "| child:", ask("free"))
    call("cuMemFreeAsync", p, None)
    call("cuCtxSynchronize")
    print(f"both freed: held {f0 - free_gib():.3f} GiB")
    call("cuMemPoolDestroy", pool)
    os.close(fd)
    time.sleep(0.2)
    print(f"parent destroyed its pool and closed its FD (the child still holds its import of the pool): held {f0 - free_gib():.3f}")
    print("child:", ask("destroy"))
    time.sleep(0.2)
    print(f"the child destroyed its imported pool: held {f0 - free_gib():.3f}")
    print("child:", ask("exit"))
    c.wait()
    time.sleep(0.3)
    print(f"the child exited: held {f0 - free_gib():.3f} (its context, ~0.5 GiB, goes too)")


if __name__ == "__main__":
    main()
