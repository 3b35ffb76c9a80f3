"""One thread keeps several workers busy: a job in flight on each, and whichever ends first
gets its worker the next one (`poolipc.wait_any`), torch-free.

Under MPS one thread driving four torch workers this way ran 3.5-3.7x one worker's jobs/s
on an H100, more than a thread per worker (2.6-2.7x: each job's return waits for the GIL
from another thread); see "Several workers at once" in docs/performance.md.

    POOLIPC_DRIVER=sim python fan_out.py     # no GPU needed; unset: the GPU
"""

import os
import struct
import time

import poolipc

WORKERS, JOBS_EACH, N = 3, 5, 64

parent = poolipc.Parent(0)
script = os.path.join(os.path.dirname(__file__), "handoff_worker.py")  # doubles its input
workers = [parent.spawn_python(script) for _ in range(WORKERS)]
inputs = []
for i in range(WORKERS):
    buf = parent.alloc(4 * N, dtype="float32", shape=[N])
    parent.write(buf.ptr, struct.pack(f"<{N}f", *(float(i * 1000 + k) for k in range(N))))
    inputs.append((buf, poolipc.TensorRef(buf.ptr, "float32", [N])))

t0 = time.perf_counter()
handles = [parent.submit(w, [ref]) for w, (_, ref) in zip(workers, inputs)]
owner = list(range(WORKERS))  # handles[k] is a job of workers[owner[k]]
left = [JOBS_EACH - 1] * WORKERS
done = 0
while handles:
    k = poolipc.wait_any(handles)  # the index of a handle whose job ended
    i = owner[k]
    (result,) = handles[k].wait()  # at once: the job ended
    got = struct.unpack(f"<{N}f", parent.read(result.ptr, result.nbytes))
    assert got == tuple(2.0 * (i * 1000 + k2) for k2 in range(N)), f"worker {i}: wrong bytes"
    done += 1
    if left[i]:
        left[i] -= 1
        handles[k] = parent.submit(workers[i], [inputs[i][1]])
    else:
        handles.pop(k)
        owner.pop(k)
secs = time.perf_counter() - t0
print(f"one thread, {WORKERS} workers: {done} jobs, every answer right, {done / secs:.0f} jobs/s")
for w in workers:
    parent.stop(w)
