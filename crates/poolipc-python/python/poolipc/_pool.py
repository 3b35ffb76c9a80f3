"""The process's pool and torch: ``install_pool`` (the swap, before ``import torch``),
``empty_cache``, ``start_mps``, and the patches that make ``torch.cuda``'s memory figures and
``empty_cache`` the pool's. Re-exported by ``poolipc``."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from . import _native
from ._native import MpsError, PoolipcError, memory_stats
from ._native import empty_cache as _native_empty_cache
from ._types import InstallInfo, MemoryStats, ParentConfig, parent_config

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger("poolipc")

ALLOC_CONF: Final = "PYTORCH_CUDA_ALLOC_CONF"
ASYNC_BACKEND: Final = "backend:cudaMallocAsync"
_DISABLE_FLAG: Final = "--disable-cuda-malloc"

def _say(msg: str, level: int = logging.INFO) -> None:
    """One log line on the ``poolipc`` logger; on stderr too when nothing handles logging yet
    (a prestartup script runs before some ComfyUI versions configure logging)."""
    # Before logging is configured a log call drops INFO and logging's last-resort handler
    # prints WARNING: print it ourselves instead, once.
    if logging.getLogger().hasHandlers() or log.handlers:
        log.log(level, msg)
    else:
        print(msg, file=sys.stderr, flush=True)


def _ordinal(device: int) -> int:
    """A device ordinal as given, checked: an int (``TypeError`` otherwise), 0 or more
    (``ValueError`` otherwise), so that a wrong one is a clear error here rather than an
    ``OverflowError`` from the native module."""
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"poolipc: a device ordinal is an int, not {type(device).__name__}")
    if device < 0:
        raise ValueError(f"poolipc: device {device} is not an ordinal (0 or more)")
    return device


def _backend_choice(conf: str | None, argv: list[str]) -> tuple[str | None, str | None]:
    """What ``PYTORCH_CUDA_ALLOC_CONF`` should become, and why the swap cannot take effect.

    Returns ``(new_value or None to leave it, reason or None)``.
    """
    if _DISABLE_FLAG in argv:
        return None, f"ComfyUI was started with {_DISABLE_FLAG} (torch keeps its native allocator)"
    conf = (conf or "").strip()
    keys = [k.strip() for k in conf.split(",") if k.strip()]
    backends = [k.split(":", 1)[1].strip() for k in keys if k.split(":", 1)[0].strip() == "backend"]
    if not backends:
        return (",".join(keys + [ASYNC_BACKEND])), None
    if all(b == "cudaMallocAsync" for b in backends):
        return None, None
    return None, f"{ALLOC_CONF}={conf!r} chose another allocator backend"


def start_mps(
    *, accept_shared_gpu_faults: bool = False, control: str | os.PathLike[str] | None = None
) -> str:
    """Start a private CUDA MPS daemon for this process and the workers it starts from now on.

    Under MPS a handoff skips the GPU's turn-taking between processes (about 40 µs round
    trip instead of 320 µs on an H200). The price: **a GPU fault in any worker ends the CUDA
    context of every client, this process included** (``ContextLostError`` from then on; the
    process must restart). So it refuses unless ``accept_shared_gpu_faults=True``: use it only
    for workers you trust.

    Call it first thing, before anything initialises CUDA (before torch touches the GPU).
    Nothing system-wide changes; the daemon quits once this process and its workers exited.
    Returns the daemon's pipe directory (also set as ``CUDA_MPS_PIPE_DIRECTORY`` in
    ``os.environ``, which workers inherit). Raises ``MpsError`` when refused or failed.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise MpsError(
            "MPS not started: torch has already initialised CUDA in this process, which would "
            "stay outside the MPS server; call poolipc.start_mps() before anything touches the GPU"
        )
    pipe = _native.start_mps(accept_shared_gpu_faults=accept_shared_gpu_faults, control=control)
    os.environ["CUDA_MPS_PIPE_DIRECTORY"] = pipe
    os.environ["CUDA_MPS_LOG_DIRECTORY"] = os.path.join(os.path.dirname(pipe), "log")
    _say(
        f"poolipc: started a private MPS daemon ({pipe}); this process and its workers share one "
        "GPU context: a GPU fault in any of them ends all of them"
    )
    return pipe


def install_pool(device: int = 0, **options: Unpack[ParentConfig]) -> InstallInfo:
    """Swap the device's current memory pool for poolipc's shareable one. Call it before
    ``import torch`` (ComfyUI: from the pack's ``prestartup_script.py``).

    This creates the process's one parent; its ``options`` (``ParentConfig``: the deadlines
    in seconds and the result memory, ``results="pool"``, the default, or ``"arena"``, sized
    by ``arena_bytes`` and capped by ``arena_max_bytes``) are set here when given, and a later
    ``Parent`` with other values is a ``ValueError``.

    Refuses (``PoolipcError``) when torch is already imported: torch picks its allocator once.
    Puts ``backend:cudaMallocAsync`` into ``PYTORCH_CUDA_ALLOC_CONF`` unless the user chose
    otherwise (another backend, or ComfyUI's ``--disable-cuda-malloc``); then the swap has no
    effect on torch and handoffs cannot take the zero-copy rung, which is said in the log.
    Returns an ``InstallInfo`` dict: ``installed`` (False when the pool already was),
    ``driver``, ``device``, ``effective`` (whether torch will allocate from the pool),
    ``reason`` (why not).

    Raises ``PoolipcError`` (torch already imported, no usable driver, the pool cannot be
    installed) and ``ValueError`` (a deadline not more than 0, an unknown ``results``, arena
    sizes without ``results="arena"``, another device or other options than the process's
    parent has).
    """
    config = parent_config(options, "install_pool")
    device = _ordinal(device)
    if "torch" in sys.modules:
        raise PoolipcError(
            "poolipc.install_pool: torch is already imported, so its allocator is chosen and "
            "the pool swap would not reach it; call install_pool() before `import torch` "
            "(in ComfyUI, from a prestartup_script.py)"
        )
    new_conf, reason = _backend_choice(os.environ.get(ALLOC_CONF), sys.argv)
    if new_conf is not None:
        os.environ[ALLOC_CONF] = new_conf
    native = _native._install(device, config)
    # On the simulated driver, processes started from here on (multiprocessing's children,
    # which receive shared memory by poolipc.torch_sharing) reach the same simulated machine.
    child_env = _native._child_env()
    if child_env is not None:
        os.environ[child_env[0]] = child_env[1]
    info = InstallInfo(
        installed=native["installed"],
        driver=native["driver"],
        device=native["device"],
        effective=reason is None,
        reason=reason,
    )
    if reason is None:
        if _torch_stats_wanted():
            figures = (
                "torch.cuda.memory_stats(), memory_allocated() and memory_reserved() will report "
                f"the pool ({_STATS_ENV}=0: they read 0), as poolipc.memory_stats() and "
                "`poolipc doctor` do"
            )
        else:
            figures = (
                "torch.cuda.memory_allocated() and memory_reserved() will read 0 - the true "
                "figures are in poolipc.memory_stats() and `poolipc doctor`"
            )
        _say(
            f"poolipc: installed a shareable CUDA memory pool as device {device}'s current pool "
            f"({info['driver']}, {ALLOC_CONF}={os.environ.get(ALLOC_CONF)}); {figures}"
        )
    else:
        _say(
            f"poolipc: installed a shareable CUDA memory pool on device {device}, but the swap "
            f"has no effect: {reason}; torch's tensors will not come from the pool, so handoffs "
            "cannot go by pool pointer (they take the copy rung)",
            logging.WARNING,
        )
    _hook_torch(device, effective=reason is None)
    return info


def empty_cache() -> int:
    """Give the shared pool's unused memory back to the device: what
    ``torch.cuda.empty_cache()`` does for torch's own pool. Waits for all of this process's
    GPU work (so that frees queued on any stream have run), then trims the pool to nothing.
    Returns the bytes given back. With the pool installed, ``torch.cuda.empty_cache()`` calls
    it too (after torch's own). Costs the synchronize, and the next allocations map memory
    again rather than reuse the pool's.

    Memory lent to a worker by pool pointer and freed is not given back by a trim (the driver
    keeps an exported allocation's memory until its pool is destroyed): a pool that lent
    anything is rotated (a new pool becomes the device's current one, every worker is given
    it) and the old one destroyed, in the workers and here, once nothing of it is in use.
    Costs more then: the new pool maps its memory afresh, and the first lend of each new
    allocation exports it again. ``memory_stats()`` sums the pool's generations;
    ``mem_get_info()`` shows the device memory that came back. ``PoolipcError`` before
    ``install_pool`` or when the driver refuses."""
    return int(_native_empty_cache())


def _patch_torch_empty_cache(cuda: Any) -> None:
    """Make ``torch.cuda.empty_cache()`` trim poolipc's pool too (once)."""
    original = getattr(cuda, "empty_cache", None)
    if original is None or getattr(original, "_poolipc", False):
        return

    def empty_cache_and_pool() -> None:
        original()
        if _native.is_installed():
            _native_empty_cache()

    empty_cache_and_pool._poolipc = True  # type: ignore[attr-defined]
    empty_cache_and_pool.__doc__ = original.__doc__
    cuda.empty_cache = empty_cache_and_pool


_EMPTY_CACHE_ENV: Final = "POOLIPC_TORCH_EMPTY_CACHE"
_STATS_ENV: Final = "POOLIPC_TORCH_STATS"

# torch's keys that get the pool's figures, from which of them: torch's cudaMallocAsync
# backend itself reports allocated = active = the pool's used bytes (getDeviceStats).
_POOL_KEYS: Final = (
    ("allocated_bytes", "used_current", "used_high"),
    ("active_bytes", "used_current", "used_high"),
    ("reserved_bytes", "reserved_current", "reserved_high"),
)


def _torch_stats_wanted() -> bool:
    return os.environ.get(_STATS_ENV, "1") != "0"


def _with_pool_figures(stats: Mapping[str, Any], pool: MemoryStats) -> dict[str, Any]:
    """torch's nested statistics with ``{allocated,active,reserved}_bytes.all.{current,peak}``
    replaced by (or set to) the pool's figures; every other key as torch gave it."""
    out = dict(stats)
    for key, current, high in _POOL_KEYS:
        kinds = dict(out.get(key) or {})
        everything = dict(kinds.get("all") or {})
        everything["current"] = pool[current]  # type: ignore[literal-required]
        everything["peak"] = pool[high]  # type: ignore[literal-required]
        kinds["all"] = everything
        out[key] = kinds
    return out


def _patch_torch_memory_stats(cuda: Any, pool_device: int) -> None:
    """Make torch's memory statistics for ``pool_device`` report the pool (once).

    torch's ``memory_stats``, ``memory_allocated``, ``memory_reserved`` and their ``max_``
    read ``torch.cuda.memory.memory_stats_as_nested_dict``, and ``reset_max_memory_allocated``
    calls ``torch.cuda.memory.reset_peak_memory_stats``: those two are wrapped, in
    ``torch.cuda.memory`` and where ``torch.cuda`` re-exports them. The driver is asked with
    ``pool_device`` current (``torch.cuda.device``), so a caller's current device stays its own.
    """
    memory: Any = getattr(cuda, "memory", None)
    needed = ("memory_stats_as_nested_dict", "reset_peak_memory_stats", "is_initialized",
              "_get_device_index")
    missing = [name for name in needed if not callable(getattr(memory, name, None))]
    if missing:
        _say(
            f"poolipc: this torch's torch.cuda.memory has no {', '.join(missing)}, so its memory "
            "figures stay its own (0 for the pool); the pool's are in poolipc.memory_stats()",
            logging.WARNING,
        )
        return
    nested = memory.memory_stats_as_nested_dict
    reset = memory.reset_peak_memory_stats
    is_initialized = memory.is_initialized
    device_index = memory._get_device_index
    if getattr(nested, "_poolipc", False):
        return

    def ours(which: Any) -> bool:
        """Whether ``which`` (a device as torch takes it) is the pool's device; False until
        torch has started CUDA (torch's answer is then ``{}``, and naming the current device
        would start it)."""
        if not _native.is_installed() or not is_initialized():
            return False
        return bool(device_index(which, optional=True) == pool_device)

    @functools.wraps(nested)
    def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
        stats = nested(device=device)
        if not ours(device):
            return stats  # type: ignore[no-any-return]
        with cuda.device(pool_device):
            pool = memory_stats()
        return _with_pool_figures(stats, pool)

    @functools.wraps(reset)
    def reset_peak_memory_stats(device: Any = None) -> None:
        reset(device=device)
        if ours(device):
            with cuda.device(pool_device):
                _native.reset_peak_memory_stats()

    patched: tuple[tuple[str, Any, Any], ...] = (
        ("memory_stats_as_nested_dict", memory_stats_as_nested_dict, nested),
        ("reset_peak_memory_stats", reset_peak_memory_stats, reset),
    )
    for name, new, original in patched:
        new._poolipc = True
        setattr(memory, name, new)
        if getattr(cuda, name, None) is original:
            setattr(cuda, name, new)


class _TorchCudaHook:
    """A meta-path finder that patches ``torch.cuda`` once it has loaded: the pool is
    installed before torch is imported, so torch is not there yet."""

    def __init__(self, patches: Sequence[Callable[[Any], None]]) -> None:
        self.patches = list(patches)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torch.cuda":
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec
        patches = self.patches

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            for patch in patches:
                patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _hook_torch(device: int, *, effective: bool) -> None:
    """Patch ``torch.cuda`` now if it is loaded, else when it loads: ``empty_cache`` unless
    ``POOLIPC_TORCH_EMPTY_CACHE=0``; the memory statistics when the swap reaches torch
    (``effective``: else torch's tensors are not the pool's) unless ``POOLIPC_TORCH_STATS=0``."""
    patches: list[Callable[[Any], None]] = []
    if os.environ.get(_EMPTY_CACHE_ENV, "1") != "0":
        patches.append(_patch_torch_empty_cache)
    if effective and _torch_stats_wanted():
        patches.append(functools.partial(_patch_torch_memory_stats, pool_device=device))
    if not patches:
        return
    cuda = sys.modules.get("torch.cuda")
    if cuda is not None:
        for patch in patches:
            patch(cuda)
    elif not any(isinstance(f, _TorchCudaHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchCudaHook(patches))
