"""A stand-in for poolipc's Parent as bench/pybench.py uses it (see ../README.md): each job
takes 0.2 ms, on the caller's thread (run) or in wait (submit)."""
import time


def install_pool(device):
    pass


class _Handle:
    def wait(self):
        time.sleep(0.0002)
        return []


class Parent:
    options = {"io_threads": 2}

    def __init__(self, device):
        self.n = 0

    def spawn(self, argv):
        self.n += 1
        return self.n

    def run(self, worker, inputs, stream=None):
        time.sleep(0.0002)
        return []

    def submit(self, worker, inputs, stream=None):
        return _Handle()

    def stats(self):
        return {"io_busy_ns": time.perf_counter_ns() // 10}

    def stop(self, worker):
        return 0
