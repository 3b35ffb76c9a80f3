"""run.sh's diagnostics, loaded by ComfyUI as a one-file custom node (custom_nodes/
zz_poolipc_probe.py) after ComfyUI set up torch: one line saying what torch and poolipc's
prestartup ended up with inside the ComfyUI process. It defines no nodes."""
import os
import sys

NODE_CLASS_MAPPINGS = {}


def _line():
    parts = [f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')!r}",
             f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}"]
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            parts.append(f"torch {torch.__version__} allocator backend {torch.cuda.get_allocator_backend()!r}")
        except Exception as e:  # noqa: BLE001 - a diagnostic never breaks startup
            parts.append(f"torch allocator backend unknown ({type(e).__name__}: {e})")
    state = sys.modules.get("_poolipc_comfyui_startup")
    parts.append(
        "poolipc prestartup: "
        + (f"mode={state.mode} device={state.device} reason={state.reason!r}" if state is not None else "never ran")
    )
    parts.append(f"poolipc imported: {'poolipc' in sys.modules}")
    return "poolipc-probe: " + "; ".join(parts)


print(_line(), file=sys.stderr, flush=True)
