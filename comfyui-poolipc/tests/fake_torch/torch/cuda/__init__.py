"""A stand-in for torch.cuda, reduced to the memory figures: what poolipc wraps and ComfyUI
reads, wired as torch 2.11 wires them (torch/cuda/__init__.py and torch/cuda/memory.py): the
device helpers live here, the statistics in `memory`, re-exported here by name.

`_C` stands for torch's native side under `backend:cudaMallocAsync` with poolipc's pool
swapped in: its figures are those of the device's *default* pool, which serves nothing, so 0
unless a test sets them; `mem_get_info` is a device-level figure a test sets.
"""
import contextlib


class _Native:
    """torch._C's CUDA memory calls, with the state a test sets."""

    def __init__(self):
        self.initialized = True
        self.current = 0
        self.own = {}  # device -> (allocated, reserved): torch's own figures, 0 by default
        self.peak_resets = []  # devices torch's own resetPeakStats was asked for
        self.mem_info = (40 << 30, 80 << 30)  # (free, total) bytes, device level

    def _cuda_memoryStats(self, device):
        allocated, reserved = self.own.get(device, (0, 0))

        def stat(current):
            one = {"current": current, "peak": current, "allocated": current, "freed": 0}
            return {"all": dict(one), "large_pool": dict(one), "small_pool": {k: 0 for k in one}}

        # The keys torch's memoryStats gives for every backend; cudaMallocAsync fills only
        # allocated/active/reserved bytes' "all", the rest reads 0.
        return {
            "num_alloc_retries": 0,
            "num_ooms": 0,
            "num_sync_all_streams": 0,
            "max_split_size": -1,
            "allocation": stat(0),
            "segment": stat(0),
            "active": stat(0),
            "inactive_split": stat(0),
            "allocated_bytes": stat(allocated),
            "active_bytes": stat(allocated),
            "reserved_bytes": stat(reserved),
            "inactive_split_bytes": stat(0),
            "requested_bytes": stat(allocated),
            "oversize_allocations": {"current": 0, "peak": 0, "allocated": 0, "freed": 0},
            "oversize_segments": {"current": 0, "peak": 0, "allocated": 0, "freed": 0},
        }

    def _cuda_resetPeakMemoryStats(self, device):
        self.peak_resets.append(device)


_C = _Native()


def is_initialized():
    return _C.initialized


def current_device():
    return _C.current


def _get_device_index(device, optional=False):
    """As torch.cuda._utils._get_device_index: an int as it is; "cuda", "cuda:N" or an object
    with `type` and `index` (torch.device); None (with `optional`) or no index: the current
    device."""
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        device = _Device(kind, int(index) if index else None)
    if isinstance(device, int):
        return device
    if device is None:
        if not optional:
            raise ValueError("Expected a torch.device with a specified index or an integer, but got:None")
        return current_device()
    if device.type != "cuda":
        raise ValueError(f"Expected a cuda device, but got: {device}")
    return current_device() if device.index is None else device.index


class _Device:
    def __init__(self, type, index=None):
        self.type, self.index = type, index


@contextlib.contextmanager
def device(which):
    """As torch.cuda.device: `which` current inside the block, the previous one after it."""
    prev = _C.current
    _C.current = _get_device_index(which, optional=True)
    try:
        yield
    finally:
        _C.current = prev


def mem_get_info(device=None):
    return _C.mem_info


def empty_cache():
    pass


from . import memory  # noqa: E402  (torch.cuda imports it after the helpers above, too)
from .memory import (  # noqa: E402
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_reserved,
    memory_stats,
    memory_stats_as_nested_dict,
    reset_max_memory_allocated,
    reset_peak_memory_stats,
)

__all__ = [
    "device",
    "current_device",
    "is_initialized",
    "mem_get_info",
    "empty_cache",
    "memory",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_max_memory_allocated",
]
