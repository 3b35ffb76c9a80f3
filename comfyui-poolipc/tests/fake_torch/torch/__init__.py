"""A stand-in for torch in the startup tests: it records what torch would have seen when it
was imported (torch reads both variables once, when CUDA starts)."""
import os

print(
    "TORCH IMPORTED CUDA_VISIBLE_DEVICES=%s PYTORCH_CUDA_ALLOC_CONF=%s"
    % (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("PYTORCH_CUDA_ALLOC_CONF")),
    flush=True,
)
