"""The pack's two example nodes: start a configured worker, and invert an image in it.

- "poolipc: start worker" takes a worker NAME from the server's configuration
  (``worker_config``); a workflow cannot name a program.
- "poolipc: invert in worker" lends the image to the worker, which writes ``1 - image`` into
  a result the parent allocated, and says which rung each tensor took (log line, the node's
  ``rungs`` output and its text in the UI).

Both refuse, with what to do, unless poolipc was enabled at startup (``POOLIPC_ENABLE=1``, so
the prestartup script swapped the pool before torch started): they never swap torch's pool in
the middle of a run. They use ComfyUI's torch device, and refuse under ``--cpu``.
"""

from __future__ import annotations

import logging
import os
import sys

from . import worker_config
from .worker_registry import Registry, WorkerHandle

log = logging.getLogger("poolipc")

_PARENTS = {}


def _parent(device):
    import poolipc

    if device not in _PARENTS:
        _PARENTS[device] = poolipc.Parent(device)
    return _PARENTS[device]


REGISTRY = Registry(_parent)


def _enabled() -> bool:
    return os.environ.get("POOLIPC_ENABLE", "").strip().lower() in ("1", "true", "yes", "on")


def comfy_cuda_device() -> int:
    """ComfyUI's torch device as a CUDA ordinal; a clear refusal when it is not CUDA."""
    import comfy.model_management as mm

    dev = mm.get_torch_device()
    if getattr(dev, "type", None) != "cuda":
        raise RuntimeError(
            f"poolipc: refused: ComfyUI runs on {dev} (started with --cpu?); poolipc hands CUDA "
            "tensors to worker processes and needs ComfyUI on a CUDA device"
        )
    return dev.index if dev.index is not None else 0


def _installed_by_binding() -> bool:
    try:
        import poolipc
    except ImportError:
        return False
    check = getattr(poolipc, "is_installed", None)
    try:
        return bool(check()) if check is not None else False
    except Exception:  # noqa: BLE001 - an answer we cannot read is a no
        return False


def ready_device() -> int:
    """The CUDA device the nodes work on, once poolipc was enabled at startup and agrees with
    ComfyUI about the device; otherwise a ``RuntimeError`` saying what to do."""
    if not _enabled():
        raise RuntimeError(
            "poolipc: refused: poolipc is not enabled. Start ComfyUI with POOLIPC_ENABLE=1 in its "
            "environment: the pack's prestartup script then swaps torch's CUDA memory pool before "
            "torch starts. The nodes do not swap it in the middle of a run (torch has allocated "
            "already; its memory would be split between two pools, unannounced)."
        )
    device = comfy_cuda_device()
    state = sys.modules.get("_poolipc_comfyui_startup")
    mode = getattr(state, "mode", None)
    if mode == "host-staging":
        return device
    if mode == "installed" or (mode is None and _installed_by_binding()):
        installed_on = getattr(state, "device", None)
        if installed_on is not None and installed_on != device:
            raise RuntimeError(
                f"poolipc: refused: the pool was installed on CUDA device {installed_on} but ComfyUI "
                f"runs on device {device}; drop POOLIPC_DEVICE and choose the GPU with ComfyUI's "
                "--cuda-device, which poolipc follows"
            )
        return device
    if mode == "failed":
        raise RuntimeError(
            f"poolipc: refused: poolipc could not install its pool at startup: {state.reason}. "
            "Fix that and restart ComfyUI (the nodes do not swap torch's pool mid-run)."
        )
    raise RuntimeError(
        "poolipc: refused: the pack's prestartup_script.py did not install poolipc's pool in this "
        f"process (startup state: {mode or 'prestartup never ran'}); restart ComfyUI with "
        "POOLIPC_ENABLE=1 and the pack in custom_nodes"
    )


def _rung_lists(rungs):
    """(input rungs, result rungs) from whatever the binding reports, or None."""
    if rungs is None:
        return None
    if isinstance(rungs, dict):
        ins = rungs.get("inputs", rungs.get("input_rungs"))
        outs = rungs.get("results", rungs.get("result_rungs"))
        return (list(ins or []), list(outs or []))
    if hasattr(rungs, "input_rungs") or hasattr(rungs, "result_rungs"):
        return (list(getattr(rungs, "input_rungs", None) or []), list(getattr(rungs, "result_rungs", None) or []))
    rungs = list(rungs)
    if len(rungs) == 2 and all(isinstance(r, (list, tuple)) for r in rungs):
        return (list(rungs[0]), list(rungs[1]))
    return ([str(r) for r in rungs], [])


def run_with_rungs(parent, worker, inputs):
    """``parent.run``, with the rung each tensor took when the binding reports it:
    ``(outputs, (input rungs, result rungs) or None)``."""
    try:
        outputs, rungs = parent.run(worker, inputs, return_rungs=True)
    except TypeError as e:
        if "return_rungs" not in str(e):
            raise
        outputs = parent.run(worker, inputs)
        ins, outs = getattr(parent, "last_input_rungs", None), getattr(parent, "last_result_rungs", None)
        rungs = (ins or [], outs or []) if (ins or outs) else None
    return tuple(outputs), _rung_lists(rungs)


def describe_rungs(rungs) -> str:
    if rungs is None:
        return "rungs not reported by this poolipc build"
    ins, outs = rungs
    parts = []
    if ins:
        parts.append("input " + ", ".join(map(str, ins)))
    if outs:
        parts.append("result " + ", ".join(map(str, outs)))
    return "; ".join(parts) or "no tensors crossed"


class PoolipcStartWorker:
    """Start (or restart) a worker the server configured, by name."""

    CATEGORY = "poolipc/workers"
    RETURN_TYPES = ("POOLIPC_WORKER",)
    RETURN_NAMES = ("worker",)
    FUNCTION = "start"
    DESCRIPTION = (
        "Starts a worker process that the ComfyUI owner configured (poolipc_workers.json). "
        "Running it again stops the worker it replaces."
    )

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "worker": (
                    worker_config.names(),
                    {
                        "default": worker_config.DEFAULT_NAME,
                        "tooltip": "A worker the server configures (poolipc_workers.json); "
                        "workflows cannot name programs.",
                    },
                )
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    def start(self, worker, unique_id=None, **unexpected):
        if unexpected:
            raise RuntimeError(
                f"poolipc: refused: the workflow passes {sorted(unexpected)} to the start node; "
                "worker programs come from the server's configuration (poolipc_workers.json or "
                f"{worker_config.ENV_FILE}), a workflow only names one"
            )
        spec = worker_config.resolve(worker)
        device = ready_device()
        handle = REGISTRY.start(str(unique_id) if unique_id is not None else "start", spec, device)
        return (handle,)


class PoolipcInvertInWorker:
    """``1 - image`` computed in the worker, the image lent to it without a copy."""

    CATEGORY = "poolipc/examples"
    RETURN_TYPES = ("IMAGE", "STRING")
    RETURN_NAMES = ("image", "rungs")
    FUNCTION = "invert"
    DESCRIPTION = "Inverts the image in a poolipc worker; 'rungs' says how each tensor crossed."

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"image": ("IMAGE",), "worker": ("POOLIPC_WORKER",)}}

    def invert(self, image, worker: WorkerHandle):
        import poolipc

        parent, wid, pid = worker.registry.acquire(worker)
        x = image.to(f"cuda:{worker.device}").contiguous()
        try:
            (out,), rungs = run_with_rungs(parent, wid, [x])
        except poolipc.JobFailedError as e:
            worker.registry.lost_during_job(worker, wid, e)
            raise
        text = (
            f"poolipc: inverted an image {tuple(image.shape)} in worker {worker.name!r} "
            f"(pid {pid}): {describe_rungs(rungs)}"
        )
        log.info(text)
        # `out` is an ordinary torch tensor; torch's stream waited on the worker's DONE, so it
        # can be used at once. ComfyUI keeps images on the CPU.
        return {"ui": {"text": [text]}, "result": (out.to(image.device), text)}


NODE_CLASS_MAPPINGS = {
    "PoolipcStartWorker": PoolipcStartWorker,
    "PoolipcInvertInWorker": PoolipcInvertInWorker,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "PoolipcStartWorker": "poolipc: start worker",
    "PoolipcInvertInWorker": "poolipc: invert in worker",
}
