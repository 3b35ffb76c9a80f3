"""ComfyUI's cuda_malloc.py, reduced to its effect: add backend:cudaMallocAsync to
PYTORCH_CUDA_ALLOC_CONF unless --disable-cuda-malloc (without importing torch)."""
import os

from comfy.cli_args import args

if not args.disable_cuda_malloc:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = (
        "backend:cudaMallocAsync" if conf is None else conf + ",backend:cudaMallocAsync"
    )
