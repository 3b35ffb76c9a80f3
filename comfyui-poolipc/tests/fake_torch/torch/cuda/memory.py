"""torch.cuda.memory's statistics, wired as in torch 2.11: `memory_stats` flattens
`memory_stats_as_nested_dict` (which asks the native side once CUDA is initialised, else gives
{}), the single figures read `memory_stats`, and `reset_max_memory_allocated` calls
`reset_peak_memory_stats`, each through this module's globals."""
import collections
import warnings

from . import _C, _get_device_index, is_initialized


def memory_stats(device=None):
    result = []

    def add(prefix, obj):
        if isinstance(obj, dict):
            if prefix:
                prefix += "."
            for k, v in obj.items():
                add(prefix + str(k), v)
        else:
            result.append((prefix, obj))

    add("", memory_stats_as_nested_dict(device=device))
    result.sort()
    return collections.OrderedDict(result)


def memory_stats_as_nested_dict(device=None):
    if not is_initialized():
        return {}
    device = _get_device_index(device, optional=True)
    return _C._cuda_memoryStats(device)


def reset_peak_memory_stats(device=None):
    device = _get_device_index(device, optional=True)
    return _C._cuda_resetPeakMemoryStats(device)


def reset_max_memory_allocated(device=None):
    warnings.warn(
        "torch.cuda.reset_max_memory_allocated now calls torch.cuda.reset_peak_memory_stats, "
        "which resets /all/ peak memory stats.",
        FutureWarning,
        stacklevel=2,
    )
    return reset_peak_memory_stats(device=device)


def memory_allocated(device=None):
    return memory_stats(device=device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device=None):
    return memory_stats(device=device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device=None):
    return memory_stats(device=device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device=None):
    return memory_stats(device=device).get("reserved_bytes.all.peak", 0)
