# Copied unchanged from the project's first probes (torchmp.py): torch.multiprocessing's round trip (native
# allocator, legacy CUDA IPC), run by `poolipc bench --torchmp` beside our own round trip.
"""Peer anchor: round trip of a GPU tensor through torch.multiprocessing (legacy CUDA IPC, native allocator).
Parent puts a tensor, worker maps it, writes a value in place, records nothing more, replies; parent checks."""
import json, os, statistics, sys, time

import torch
import torch.multiprocessing as mp


def worker(q_in, q_out):
    torch.cuda.init()
    while True:
        item = q_in.get()
        if item is None:
            return
        t = item
        t[0] = 42  # in place, on the worker's stream
        torch.cuda.synchronize()
        q_out.put(1)
        del t, item


def main():
    mp.set_start_method("spawn")
    q_in, q_out = mp.Queue(), mp.Queue()
    p = mp.Process(target=worker, args=(q_in, q_out))
    p.start()
    res = {}
    for label, numel, reps in [("4KiB", 1024, 200), ("1MiB", 1 << 18, 200), ("1GiB", 1 << 28, 10), ("4GiB", 1 << 30, 5)]:
        ts = [torch.zeros(numel, dtype=torch.float32, device="cuda") for _ in range(min(reps, 4))]
        torch.cuda.synchronize()
        times = []
        for i in range(reps):
            t = ts[i % len(ts)] if label in ("4KiB", "1MiB") else torch.zeros(numel, dtype=torch.float32, device="cuda")
            t0 = time.perf_counter()
            q_in.put(t)
            q_out.get()
            times.append(time.perf_counter() - t0)
            assert float(t[0].item()) == 42.0
        res[label] = {"round_trip_ms_median": statistics.median(times[1:]) * 1e3, "first_ms": times[0] * 1e3}
        print(json.dumps({"event": "torch_mp_round_trip", "size": label, **res[label]}), flush=True)
        del ts
        torch.cuda.synchronize()
    q_in.put(None)
    p.join()


if __name__ == "__main__":
    main()
