"""A parent lends a tensor to a Python worker and reads back its answer, torch-free.

    POOLIPC_DRIVER=sim python handoff_parent.py     # no GPU needed; unset: the GPU
"""

import os
import struct

import poolipc

parent = poolipc.Parent(0)  # installs the shared pool on device 0
worker = parent.spawn_python(os.path.join(os.path.dirname(__file__), "handoff_worker.py"))
values = [float(i) for i in range(256)]
buf = parent.alloc(4 * len(values), dtype="float32", shape=[len(values)])
parent.write(buf.ptr, struct.pack(f"<{len(values)}f", *values))
(result,) = parent.run(worker, [poolipc.TensorRef(buf.ptr, "float32", [len(values)])])
doubled = struct.unpack(f"<{len(values)}f", parent.read(result.ptr, result.nbytes))
assert doubled == tuple(2 * v for v in values)
print(f"poolipc {poolipc.__version__}: lent {len(values)} float32 by {parent.last_input_rungs[0]}, got them doubled")
parent.stop(worker)
