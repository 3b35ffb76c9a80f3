"""poolipc through its Python binding against torch.multiprocessing, in one run on the GPU.

The parent is torch under cudaMallocAsync with poolipc's pool installed (as in ComfyUI); the
worker takes each tensor by DLPack into torch and writes one element in place on the job's
stream, as bench/torchmp.py's worker does. Measured per size: a new tensor each time (recycled
pool memory: its cached blob lent once export reuse is proven, else exported again), the same
live tensor lent again (the export cache's hit), and the same live tensor lent again after the
parent wrote it (``zero_()``, the kernel ``torch.zeros`` runs for each new tensor: the recycled
column's like, since without MPS the worker's kernel after a parent's kernel pays the GPU's
switch between the two contexts, whoever made the tensor); then torchmp.py runs as a child and
its medians are printed beside ours.

    PYTHONPATH=/tmp/site python3 bench/pybench.py [--json]
    PYTHONPATH=/tmp/site python3 bench/pybench.py --workers N [--json]

With ``--workers N``: jobs per second with 1, 2, 4 .. N torch workers served at once by one
parent (N threads, each with its own worker, stream and live tensor, lent again), 4 KiB and
64 MiB, beside one worker, in the same run. Each row counts the jobs done in a
window of ``POOLIPC_BENCH_WINDOW_MS`` (default 500 ms) after a warm-up, so that a row's rate
does not rest on a few tens of milliseconds; ``POOLIPC_BENCH_ROUNDS=R`` (default 1) measures
every count R times in rounds and prints the median of each count's ratio to one worker of
the same round, with its range. Then the same workers driven by the main thread
alone (``submit`` to each, ``wait`` the oldest and submit again): no GIL hand-over between
threads.

With ``--results``: the round trip of a worker that returns a result (``request_results``,
made by ``torch.empty`` on the parent's allocator thread), lent again, 4 KiB and 64 MiB,
beside the in-place worker's, with and without a busy Python thread in the parent (each
side of the job then waits for the GIL: the allocator thread and the caller's return).
"""
import json
import os
import statistics
import subprocess
import sys
import time

import poolipc

poolipc.install_pool(0)
import torch  # noqa: E402  (after install_pool)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = r"""
import poolipc, torch
w = poolipc.Worker()
for job in w:
    with job:
        for v in job.inputs:
            t = torch.from_dlpack(v)
            t.view(-1)[0] = 42
"""
RESULT_WORKER = r"""
import poolipc, torch
w = poolipc.Worker()
for job in w:
    with job:
        x = torch.from_dlpack(job.inputs[0])
        (r,) = job.request_results([("float32", list(x.shape))])
        torch.from_dlpack(r).copy_(x).add_(1)
"""
SIZES = [("4KiB", 1 << 10, 400), ("1MiB", 1 << 18, 400), ("64MiB", 1 << 24, 100),
         ("1GiB", 1 << 28, 30), ("4GiB", 1 << 30, 15)]


def counts(n):
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]


def throughput(max_workers, as_json):
    import threading

    parent = poolipc.Parent(0)
    workers = [parent.spawn([sys.executable, "-c", WORKER]) for _ in range(max_workers)]
    window = int(os.environ.get("POOLIPC_BENCH_WINDOW_MS", "500")) / 1e3
    rounds = int(os.environ.get("POOLIPC_BENCH_ROUNDS", "1"))
    if not 1 <= rounds <= 20:
        raise SystemExit(f"POOLIPC_BENCH_ROUNDS={rounds}: give 1 to 20")

    def measure(n, numel, warmup):
        """``n`` threads at once, each its own worker, stream and tensor, for ``window``:
        (jobs/s, the IO threads' busy share per thread, their busy us per job)."""
        start = threading.Barrier(n + 1)
        end = threading.Barrier(n + 1)
        errors = []
        jobs_done = []

        def serve(w):
            try:
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    t = torch.zeros(numel, dtype=torch.float32, device="cuda")
                    for _ in range(warmup):
                        parent.run(w, [t], stream=s)
                    s.synchronize()
                    start.wait()
                    deadline = time.perf_counter() + window
                    done = 0
                    while time.perf_counter() < deadline:
                        parent.run(w, [t], stream=s)
                        done += 1
                    s.synchronize()
                    jobs_done.append(done)
                    end.wait()
                    assert t[0].item() == 42.0
            except BaseException as e:  # noqa: BLE001  (reported after the barrier)
                errors.append(e)
                start.abort()
                end.abort()

        threads = [threading.Thread(target=serve, args=(w,)) for w in workers[:n]]
        for th in threads:
            th.start()
        try:
            start.wait()
            t0 = time.perf_counter()
            busy0 = parent.stats()["io_busy_ns"]
            end.wait()
            secs = time.perf_counter() - t0
            busy = (parent.stats()["io_busy_ns"] - busy0) / 1e9
        except threading.BrokenBarrierError:
            secs = busy = float("nan")
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        jobs = sum(jobs_done)
        # The parent's IO threads' busy share of the time, per thread (as many as the
        # process parent has: POOLIPC_IO_THREADS or io_threads=; near 100 %: they limit
        # the rate).
        return jobs / secs, busy / secs / parent.options["io_threads"], busy * 1e6 / jobs

    print(f"  jobs/s with N torch workers at once (one parent, each thread its own worker, stream, tensor):")
    extra = f" {'x one, range':>14}" if rounds > 1 else ""
    print(f"  {'size':>6} {'workers':>8} {'jobs/s':>10} {'x one':>7} {'IO busy':>8} {'IO us/job':>9}{extra}")
    rows = []
    for label, numel, warmup in [("4KiB", 1 << 10, 40), ("64MiB", 1 << 24, 10)]:
        ns = counts(max_workers)
        # got[n]: one (jobs/s, IO busy, IO us/job) per round; each count in every round.
        got = {n: [] for n in ns}
        for _ in range(rounds):
            for n in ns:
                got[n].append(measure(n, numel, warmup))
        for n in ns:
            # The count's ratio to one worker within each round (one worker's rate moves
            # between measurements), then the median over the rounds.
            ratios = sorted(r[0] / o[0] for r, o in zip(got[n], got[1]))
            rate = statistics.median(r[0] for r in got[n])
            vs_one = statistics.median(ratios)
            io_busy = statistics.median(r[1] for r in got[n])
            io_us = statistics.median(r[2] for r in got[n])
            spread = f" {ratios[0]:>6.2f}-{ratios[-1]:.2f}x" if rounds > 1 else ""
            print(f"  {label:>6} {n:>8} {rate:>10.0f} {vs_one:>6.2f}x {100 * io_busy:>7.0f}% {io_us:>9.2f}{spread}")
            rows.append({"size": label, "workers": n, "jobs_per_s": rate, "vs_one": vs_one,
                         "vs_one_min": ratios[0], "vs_one_max": ratios[-1], "rounds": rounds,
                         "io_busy": io_busy, "io_us_per_job": io_us})
    fanout = fanout_rows(parent, workers, window)
    for w in workers:
        parent.stop(w)
    if as_json:
        print(json.dumps({"event": "python_workers", "rows": rows, "one_thread": fanout}))


def fanout_rows(parent, workers, window):
    """The same workers driven by the main thread alone: each its own stream and tensor, a
    job submitted to each, then, as each ends (oldest first), the next to the same worker,
    for ``window`` seconds. One Python thread, so no wait for the GIL between threads."""
    print("  the same torch workers driven by one thread (submit to each, then wait the oldest, or with")
    print("  poolipc.wait_any whichever ended first, and submit again to its worker):")
    print(f"  {'size':>6} {'workers':>8} {'oldest/s':>10} {'x one':>7} {'any/s':>10} {'x one':>7}")
    rows = []
    for label, numel in [("4KiB", 1 << 10), ("64MiB", 1 << 24)]:
        one = any_one = None
        for n in counts(len(workers)):
            ws = workers[:n]
            streams = [torch.cuda.Stream() for _ in ws]
            tensors = []
            for s in streams:
                with torch.cuda.stream(s):
                    tensors.append(torch.zeros(numel, dtype=torch.float32, device="cuda"))
            for _ in range(10):
                for w, t, s in zip(ws, tensors, streams):
                    parent.run(w, [t], stream=s)
            torch.cuda.synchronize()
            rate = drive_oldest_first(parent, ws, tensors, streams, window)
            any_rate = drive_whichever_ends(parent, ws, tensors, streams, window)
            if n == 1:
                one, any_one = rate, any_rate
            assert all(t[0].item() == 42.0 for t in tensors)
            print(f"  {label:>6} {n:>8} {rate:>10.0f} {rate / one:>6.2f}x {any_rate:>10.0f} {any_rate / any_one:>6.2f}x")
            rows.append({"size": label, "workers": n, "jobs_per_s": rate, "vs_one": rate / one,
                         "wait_any_jobs_per_s": any_rate, "wait_any_vs_one": any_rate / any_one})
    return rows


def drive_oldest_first(parent, ws, tensors, streams, window):
    """One job in flight per worker; wait the oldest, submit again to its worker. Jobs/s."""
    from collections import deque

    t0 = time.perf_counter()
    deadline = t0 + window
    pending = deque((i, parent.submit(w, [t], stream=s))
                    for i, (w, t, s) in enumerate(zip(ws, tensors, streams)))
    done = 0
    while pending:
        i, h = pending.popleft()
        h.wait()
        done += 1
        if time.perf_counter() < deadline:
            pending.append((i, parent.submit(ws[i], [tensors[i]], stream=streams[i])))
    torch.cuda.synchronize()
    return done / (time.perf_counter() - t0)


def drive_whichever_ends(parent, ws, tensors, streams, window):
    """One job in flight per worker; ``poolipc.wait_any`` names the one that ended first, and
    its worker gets the next. Jobs/s."""
    t0 = time.perf_counter()
    deadline = t0 + window
    handles = [parent.submit(w, [t], stream=s) for w, t, s in zip(ws, tensors, streams)]
    owner = list(range(len(ws)))
    done = 0
    while handles:
        k = poolipc.wait_any(handles)
        handles[k].wait()
        done += 1
        i = owner[k]
        if time.perf_counter() < deadline:
            handles[k] = parent.submit(ws[i], [tensors[i]], stream=streams[i])
        else:
            handles.pop(k)
            owner.pop(k)
    torch.cuda.synchronize()
    return done / (time.perf_counter() - t0)


def with_results(as_json):
    """Round trips with a result beside the in-place ones, with and without a busy thread."""
    import threading

    parent = poolipc.Parent(0)
    inplace = parent.spawn([sys.executable, "-c", WORKER])
    result = parent.spawn([sys.executable, "-c", RESULT_WORKER])
    print("  a worker returning a result (torch.empty on the parent's allocator thread) against one")
    print("  writing in place, lent again, medians:")
    print(f"  {'size':>6} {'busy thread':>11} {'in place ms':>12} {'result ms':>10}")
    rows = []
    for busy in (False, True):
        stop = threading.Event()

        def spin():
            x = 0
            while not stop.is_set():
                x += 1

        spinner = threading.Thread(target=spin) if busy else None
        if spinner:
            spinner.start()
        try:
            for label, numel, reps in [("4KiB", 1 << 10, 200), ("64MiB", 1 << 24, 50)]:
                t = torch.zeros(numel, dtype=torch.float32, device="cuda")
                medians = []
                for w in (inplace, result):
                    times = []
                    for i in range(reps + 5):
                        t0 = time.perf_counter()
                        out = parent.run(w, [t])
                        torch.cuda.current_stream().synchronize()
                        if i >= 5:
                            times.append(time.perf_counter() - t0)
                        if w == result:
                            assert out[0][0].item() == t[0].item() + 1
                        del out
                    medians.append(statistics.median(times) * 1e3)
                print(f"  {label:>6} {str(busy):>11} {medians[0]:>12.3f} {medians[1]:>10.3f}")
                rows.append({"size": label, "busy_thread": busy, "inplace_ms": medians[0],
                             "result_ms": medians[1]})
        finally:
            stop.set()
            if spinner:
                spinner.join()
    parent.stop(inplace)
    parent.stop(result)
    if as_json:
        print(json.dumps({"event": "python_results", "rows": rows}))


def main():
    as_json = "--json" in sys.argv
    if "--results" in sys.argv:
        return with_results(as_json)
    if "--workers" in sys.argv:
        return throughput(int(sys.argv[sys.argv.index("--workers") + 1]), as_json)
    parent = poolipc.Parent(0)
    worker = parent.spawn([sys.executable, "-c", WORKER])
    dev = torch.device("cuda", 0)
    rows = []
    for label, numel, reps in SIZES:
        fresh, again, written = [], [], []
        for i in range(reps + 1):
            t = torch.zeros(numel, dtype=torch.float32, device=dev)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            parent.run(worker, [t])
            torch.cuda.current_stream().synchronize()
            if i:
                fresh.append(time.perf_counter() - t0)
            assert t[0].item() == 42.0
            del t
        t = torch.zeros(numel, dtype=torch.float32, device=dev)
        torch.cuda.synchronize()
        for i in range(reps + 1):
            t0 = time.perf_counter()
            parent.run(worker, [t])
            torch.cuda.current_stream().synchronize()
            if i:
                again.append(time.perf_counter() - t0)
        assert t[0].item() == 42.0
        # Lent again after the parent wrote it: the recycled loop's GPU work, less the export.
        for i in range(reps + 1):
            t.zero_()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            parent.run(worker, [t])
            torch.cuda.current_stream().synchronize()
            if i:
                written.append(time.perf_counter() - t0)
            assert t[0].item() == 42.0
        del t
        row = {"event": "python_round_trip", "size": label, "bytes": numel * 4,
               "recycled_ms_median": statistics.median(fresh) * 1e3,
               "relend_ms_median": statistics.median(again) * 1e3,
               "relend_written_ms_median": statistics.median(written) * 1e3, "reps": reps}
        rows.append(row)
        if as_json:
            print(json.dumps(row), flush=True)
    parent.stop(worker)
    torch.cuda.synchronize()
    peer = subprocess.run([sys.executable, os.path.join(HERE, "torchmp.py")],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=""))
    tmp = {}
    for line in peer.stdout.splitlines():
        try:
            o = json.loads(line)
        except ValueError:
            continue
        if o.get("event") == "torch_mp_round_trip":
            tmp[o["size"]] = o["round_trip_ms_median"]
    if peer.returncode != 0:
        print(f"torch.multiprocessing: NOT MEASURED: {peer.stderr.strip().splitlines()[-1:]}")
    print()
    print("  through the Python binding (torch under cudaMallocAsync) against torch.multiprocessing (native allocator, legacy IPC), medians:")
    print(f"  {'size':>6} {'recycled ms':>12} {'re-lend ms':>11} {'written ms':>11} {'rec/writ':>9} "
          f"{'torch.mp ms':>12} {'rec/t.mp':>9}")
    for r in rows:
        t = tmp.get(r["size"])
        rec, writ = r["recycled_ms_median"], r["relend_written_ms_median"]
        print(f"  {r['size']:>6} {rec:>12.3f} {r['relend_ms_median']:>11.3f} {writ:>11.3f} {rec / writ:>8.2f}x "
              f"{(f'{t:.3f}' if t else '-'):>12} {(f'{rec / t:.2f}' if t else '-'):>9}")
        r["torch_mp_ms_median"] = t
    print("  written: the live tensor zeroed by the parent before each job (the recycled loop's kernel);")
    print("  rec/writ: a new allocation's round trip against the same GPU work lent again (<= 1.1x)")
    if as_json:
        print(json.dumps({"event": "python_vs_torch_mp", "rows": rows}))


if __name__ == "__main__":
    main()
