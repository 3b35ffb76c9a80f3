"""A stand-in for poolipc's Parent as bench/pybench.py uses it (see ../README.md): each job
takes 0.2 ms, on the caller's thread (run) or from its submit (submit: wait and wait_any sleep
until it ended)."""
import time


def install_pool(device):
    pass


class _Handle:
    def __init__(self):
        self.due = time.perf_counter() + 0.0002

    def wait(self):
        time.sleep(max(0.0, self.due - time.perf_counter()))
        return []


def wait_any(handles, timeout=None):
    """The index of the handle whose job ends first, once it ended."""
    if not handles:
        raise ValueError("wait_any: no handles")
    k = min(range(len(handles)), key=lambda i: handles[i].due)
    time.sleep(max(0.0, handles[k].due - time.perf_counter()))
    return k


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
