"""The storm: THREADS threads, each with its own poolipc.Parent object and its own
worker, JOBS jobs in all; each job lends a fresh torch.randint uint8 tensor (4 KiB to 256 KiB,
made on torch's current stream just before the lend) and checks the worker's answer (input XOR
0xA5) with torch.equal. Prints wrong results, untyped errors and the pool's used bytes before
and after. --kill P: each job, with probability P, SIGKILLs the job's worker mid-job (the
thread spawns a new one).

    python3 bench/storm.py --worker bytes|torch [--threads 4] [--jobs 1000] [--kill 0.02]
"""

import argparse
import os
import random
import signal
import sys
import threading
import time

import poolipc

poolipc.install_pool()
import torch  # noqa: E402  (after the pool is installed)

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=["bytes", "torch"], default="bytes")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--kill", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    os.environ["STORM_WORKER"] = a.worker
    torch.cuda.synchronize()
    base = poolipc.memory_stats()
    counts = {"ok": 0, "wrong": 0, "typed": 0, "untyped": 0, "killed": 0}
    lock = threading.Lock()
    per_thread = a.jobs // a.threads
    errors = []

    def run(t):
        rng = random.Random(a.seed * 1000 + t)
        parent = poolipc.Parent(0)
        w = parent.spawn_python(os.path.join(HERE, "storm_worker.py"))
        for _ in range(per_thread):
            n = rng.randint(4096, 256 * 1024)
            x = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
            kill = rng.random() < a.kill
            try:
                h = parent.submit(w, [x])
                if kill:
                    time.sleep(rng.random() * 0.002)
                    pid = parent.pid(w)
                    if pid:
                        os.kill(pid, signal.SIGKILL)
                (r,) = h.wait()
                good = torch.equal(r, x ^ 0xA5)
                with lock:
                    counts["ok" if good else "wrong"] += 1
            except poolipc.PoolipcError as e:
                with lock:
                    counts["killed" if kill else "typed"] += 1
                    if not kill:
                        errors.append(repr(e))
            except Exception as e:  # noqa: BLE001  (counted: the point of the storm)
                with lock:
                    counts["untyped"] += 1
                    errors.append(repr(e))
            if kill:
                try:
                    parent.stop(w)
                except Exception:  # noqa: BLE001
                    pass
                w = parent.spawn_python(os.path.join(HERE, "storm_worker.py"))
        parent.stop(w)

    t0 = time.time()
    threads = [threading.Thread(target=run, args=(t,)) for t in range(a.threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    torch.cuda.synchronize()
    import gc

    gc.collect()
    torch.cuda.synchronize()
    after = poolipc.memory_stats()
    print(
        f"storm worker={a.worker} threads={a.threads} jobs={per_thread * a.threads} kill={a.kill}: "
        f"{counts} in {time.time() - t0:.1f} s; pool used {base} -> {after}"
    )
    for e in errors[:5]:
        print("  error:", e)
    sys.exit(0 if counts["wrong"] == 0 and counts["untyped"] == 0 else 1)


if __name__ == "__main__":
    main()
