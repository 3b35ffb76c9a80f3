"""poolipc's ComfyUI pack: an example pair of nodes that sends an image through a worker
process and back without copying it (when the prestartup hook swapped the pool).

- "poolipc: start worker" starts ``example_worker.py`` (a torch worker) and gives a handle.
- "poolipc: invert in worker" lends the image to the worker, which writes ``1 - image`` into
  a result the parent allocated (``torch.empty``, from the shared pool).

The pool swap itself happens in ``prestartup_script.py`` (``POOLIPC_ENABLE=1``).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_WORKER = os.path.join(_HERE, "example_worker.py")


class _WorkerHandle:
    """A running worker; the parent is shared by the process."""

    def __init__(self, parent, worker, device):
        self.parent, self.worker, self.device = parent, worker, device

    def __repr__(self):
        return f"poolipc worker {self.worker} on cuda:{self.device}"


_PARENTS = {}


def _parent(device):
    import poolipc

    if device not in _PARENTS:
        _PARENTS[device] = poolipc.Parent(device)
    return _PARENTS[device]


class PoolipcStartWorker:
    CATEGORY = "poolipc"
    RETURN_TYPES = ("POOLIPC_WORKER",)
    FUNCTION = "start"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"python": ("STRING", {"default": sys.executable})}}

    def start(self, python):
        import comfy.model_management as mm

        device = mm.get_torch_device().index or 0
        parent = _parent(device)
        worker = parent.spawn([python, _WORKER])
        return (_WorkerHandle(parent, worker, device),)


class PoolipcInvertInWorker:
    CATEGORY = "poolipc"
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "invert"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"image": ("IMAGE",), "worker": ("POOLIPC_WORKER",)}}

    def invert(self, image, worker):
        import torch

        x = image.to(f"cuda:{worker.device}").contiguous()
        (out,) = worker.parent.run(worker.worker, [x])
        # `out` is an ordinary torch tensor from the shared pool; torch's stream waited on
        # the worker's DONE, so it can be used at once. ComfyUI keeps images on the CPU.
        return (out.to(image.device),)


NODE_CLASS_MAPPINGS = {
    "PoolipcStartWorker": PoolipcStartWorker,
    "PoolipcInvertInWorker": PoolipcInvertInWorker,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "PoolipcStartWorker": "poolipc: start worker",
    "PoolipcInvertInWorker": "poolipc: invert in worker",
}
