"""poolipc: hand CUDA tensors between a parent process and its workers without copying them,
while the parent keeps PyTorch's stream-ordered allocator (``backend:cudaMallocAsync``).

- ``install_pool(device=0)``: before ``import torch``, make a shareable memory pool the device's
  current pool, so that torch allocates from it (ComfyUI: the pack's prestartup script).
- ``memory_stats()``: the pool's figures (used and reserved bytes, current and high);
  ``reset_peak_memory_stats()`` restarts the high marks from the current figures.
- torch's figures: after the swap torch asks the device's *default* pool, which no longer
  serves it, and would read 0. So once ``torch.cuda`` loads, ``torch.cuda.memory_stats()``
  (and ``memory_stats_as_nested_dict()``, ``memory_allocated()``, ``memory_reserved()``,
  ``max_memory_allocated()``, ``max_memory_reserved()``, ``reset_peak_memory_stats()``,
  ``reset_max_memory_allocated()``) report the pool for the pool's device: allocated and
  active bytes = the pool's used bytes, reserved bytes = its reserved bytes, ``peak`` = their
  high marks; torch's other keys and other devices stay torch's. ComfyUI's free-VRAM figure
  (``mem_get_info()`` free + reserved - active) then counts the pool's unused reserve.
  ``POOLIPC_TORCH_STATS=0`` leaves torch's functions alone; ``torch.cuda.empty_cache()``
  trims the pool too (``POOLIPC_TORCH_EMPTY_CACHE=0`` leaves it alone).
- ``Parent``: spawn workers, lend them torch tensors, get results back as torch tensors.
  One ``Parent`` may be shared by many threads: ``submit`` returns a ``JobHandle`` at once,
  jobs on different workers run at the same time, and every wait releases the GIL.
  Results come from the shared pool (``torch.empty``, the default) or, with
  ``results="arena"``, from the result arena: no export, no import limit; each comes back as
  a torch tensor over an ``ArenaResult`` (DLPack) whose block goes back when torch frees it.
- ``Worker``: in a worker process, take jobs; views and result buffers go into torch, CuPy or
  JAX by DLPack or ``__cuda_array_interface__`` without a copy.

``POOLIPC_DRIVER=sim`` runs all of it on the simulated driver (no GPU, no torch needed);
``POOLIPC_DRIVER=auto`` uses the GPU when one is usable and the simulation otherwise.
``__version__`` is the package's version.

``ALLOC_CONF`` is the name of torch's allocator setting (``PYTORCH_CUDA_ALLOC_CONF``) and
``ASYNC_BACKEND`` the value that picks the stream-ordered allocator
(``backend:cudaMallocAsync``). ``Allocator`` is the type of ``Parent.run``'s ``alloc``
callable. The dicts the module takes and returns are typed: ``ParentConfig`` (the options of
``install_pool`` and ``Parent``), ``InstallInfo``, ``MemoryStats``, ``ParentOptions``,
``ParentStats``, ``ArenaStats`` (``TypedDict``\\ s).

Errors: ``PoolipcError`` (a ``RuntimeError``) for anything of poolipc's;
``JobFailedError`` when a job's worker was lost (``.worker``, ``.reason``, ``.detail``);
``WorkerError``, a ``JobFailedError``, when the worker reported an error for the job;
``UnknownWorkerError``, a ``PoolipcError`` and a ``KeyError``, for a worker id the parent does
not serve; ``ArenaFullError``, a ``WorkerError`` and a ``MemoryError``, when a result would pass
the result arena's cap; ``ValueError`` for a tensor that cannot be lent (naming which input and why) and
for options that cannot work; ``ExpiredViewError`` for a view used after its job; ``ConnectError``, a ``PoolipcError``, when
``Worker.connect`` finds no parent listening at the path.

Workers someone else starts (pyisolate's children): ``Parent.listen()`` gives a ``Listener``
whose ``env()`` (``POOLIPC_CONNECT``) goes to the child, which calls ``Worker.connect()``; the
host learns the worker's id from ``listener.accept(timeout)``. ``poolipc.pyisolate`` builds
pyisolate's tensor transport on it.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

from . import _native
from ._native import (
    __version__,
    ArenaFullError,
    ArenaResult,
    ConnectError,
    LeaseHold,
    ContextLostError,
    DeviceBuffer,
    ExpiredViewError,
    Job,
    JobFailedError,
    MpsError,
    NativeListener,
    PoolipcError,
    UnknownWorkerError,
    View,
    WorkerError,
    mem_get_info,
    memory_stats,
    mps_status,
    reset_peak_memory_stats,
)
from ._native import empty_cache as _native_empty_cache
from ._types import (
    ArenaStats,
    InputSpec,
    InstallInfo,
    MemoryStats,
    MpsStatus,
    ParentConfig,
    ParentOptions,
    ParentStats,
    parent_config,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "__version__",
    "install_pool",
    "memory_stats",
    "mem_get_info",
    "reset_peak_memory_stats",
    "empty_cache",
    "Parent",
    "JobHandle",
    "Worker",
    "Job",
    "View",
    "DeviceBuffer",
    "ArenaResult",
    "Listener",
    "LeaseHold",
    "TensorRef",
    "PoolipcError",
    "JobFailedError",
    "WorkerError",
    "UnknownWorkerError",
    "ArenaFullError",
    "ExpiredViewError",
    "ContextLostError",
    "ConnectError",
    "MpsError",
    "start_mps",
    "mps_status",
    "ALLOC_CONF",
    "ASYNC_BACKEND",
    "InstallInfo",
    "MemoryStats",
    "ParentConfig",
    "ParentOptions",
    "ParentStats",
    "ArenaStats",
    "MpsStatus",
    "Allocator",
]

log = logging.getLogger("poolipc")

Listener = NativeListener
"""What ``Parent.listen`` returns: ``path``, ``env()``, ``accept(timeout)``, ``refused``,
``close()``."""

CONNECT_ENV: Final = _native.CONNECT_ENV
CONNECT_TOKEN_ENV: Final = _native.CONNECT_TOKEN_ENV
"""``POOLIPC_CONNECT``: where a worker started by someone else finds its parent's listener."""

ALLOC_CONF: Final = "PYTORCH_CUDA_ALLOC_CONF"
ASYNC_BACKEND: Final = "backend:cudaMallocAsync"
_DISABLE_FLAG: Final = "--disable-cuda-malloc"
_RESULTS: Final = ("pool", "arena")

Allocator = Callable[[str, tuple[int, ...], int], Any]
"""What ``Parent.run``/``submit`` take as ``alloc``: ``alloc(dtype, shape, nbytes)`` returns the
result's owner, an object with ``data_ptr()`` (a torch tensor) or ``ptr`` (a ``DeviceBuffer``)."""


class _HasCudaStream(Protocol):
    """A torch stream, as far as poolipc reads it."""

    @property
    def cuda_stream(self) -> int: ...


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


class TensorRef:
    """A tensor described by hand, for callers without torch: device address of element 0,
    dtype name (``float32``, ``bfloat16``, ...), shape, and strides in elements (None:
    contiguous)."""

    __slots__ = {
        "ptr": "The device address of element 0.",
        "dtype": "The dtype's name (torch's spelling: ``float32``, ``bfloat16``, ...).",
        "shape": "The shape, a tuple of ints.",
        "strides": "The strides in elements, or None for a contiguous tensor.",
    }

    ptr: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None

    def __init__(
        self, ptr: int, dtype: str, shape: Iterable[int], strides: Iterable[int] | None = None
    ) -> None:
        """Describe a tensor: see the class. Raises ``ValueError``/``TypeError`` for a
        ``ptr``, a shape or strides that are not integers."""
        self.ptr = int(ptr)
        self.dtype = str(dtype)
        self.shape = tuple(int(d) for d in shape)
        self.strides = None if strides is None else tuple(int(s) for s in strides)

    def __repr__(self) -> str:
        return f"TensorRef(ptr={self.ptr:#x}, dtype={self.dtype}, shape={self.shape}, strides={self.strides})"


def _is_torch_tensor(x: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _describe(x: Any) -> InputSpec:
    """``(ptr, dtype, shape, strides)`` of a torch tensor, a TensorRef, or a view-like object
    (``ptr``/``data_ptr()``, ``dtype``, ``shape``, ``strides``)."""
    if _is_torch_tensor(x):
        if not x.is_cuda:
            raise ValueError(f"poolipc: a {x.device} tensor cannot be lent; lend CUDA tensors")
        # data_ptr() already counts the storage offset; strides are in elements.
        return (x.data_ptr(), str(x.dtype).removeprefix("torch."), list(x.shape), list(x.stride()))
    if isinstance(x, TensorRef):
        return (x.ptr, x.dtype, list(x.shape), None if x.strides is None else list(x.strides))
    ptr = x.data_ptr() if callable(getattr(x, "data_ptr", None)) else getattr(x, "ptr", None)
    if ptr is None:
        raise TypeError(f"poolipc: cannot lend {type(x).__name__}: give a torch tensor or a TensorRef")
    strides = getattr(x, "strides", None)
    return (int(ptr), str(x.dtype), list(x.shape), None if strides is None else list(strides))


def _read_only_flags(read_only: bool | Iterable[bool], n: int) -> list[bool]:
    """One read-only flag per input: ``read_only`` for all of them, or one each."""
    if isinstance(read_only, bool):
        return [read_only] * n
    flags = [bool(f) for f in read_only]
    if len(flags) != n:
        raise ValueError(f"poolipc: read_only has {len(flags)} flags for {n} inputs")
    return flags


class JobHandle:
    """A job submitted with ``Parent.submit``: ``wait()`` for its results from any thread.

    ``wait(timeout=None)`` releases the GIL while it waits and returns what ``Parent.run``
    returns (the results, in the order the worker requested them), or raises the job's error:
    ``JobFailedError`` (the worker was lost), ``WorkerError`` (it reported an error),
    ``ValueError`` (an input was refused). ``timeout`` in seconds: ``TimeoutError`` if the job
    is still running then (wait again later). Waiting again, or from two threads, gives the
    same results. ``input_rungs`` and ``result_rungs`` say how each tensor crossed, once the
    job ended. A handle dropped unwaited lets the job run to its end (it keeps the inputs
    alive until then) and frees its results.
    """

    __slots__ = {
        "_native": "The native handle.",
        "_inputs": "The lent objects, alive until the job ended.",
        "input_rungs": "How each input crossed (``pool pointer``, ``host staging``), once the "
        "job ended; None before.",
        "result_rungs": "How each result crossed, once the job ended; None before.",
        "_torch": "Whether arena results become torch tensors (torch.from_dlpack).",
        "_results": "The results once converted, so that waiting again gives the same objects.",
    }

    input_rungs: list[str] | None
    result_rungs: list[str] | None

    def __init__(
        self, native: _native.NativeJobHandle, inputs: list[Any], torch_results: bool = False
    ) -> None:
        """Made by ``Parent.submit``, not by hand."""
        self._native = native
        self._inputs: list[Any] | None = inputs
        self._torch = torch_results
        self._results: list[Any] | None = None
        self.input_rungs = None
        self.result_rungs = None

    @property
    def id(self) -> int:
        """The job's id (the worker's ``job.id``)."""
        return self._native.id

    @property
    def worker(self) -> int:
        """The id of the worker the job runs on."""
        return self._native.worker

    @property
    def done(self) -> bool:
        """Whether the job has ended (``wait`` returns or raises at once)."""
        return self._native.done

    def wait(self, timeout: float | None = None) -> list[Any]:
        """The job's results, in the order the worker requested them: torch tensors (or what
        ``alloc`` made, or ``DeviceBuffer``\\ s, or ``ArenaResult``\\ s without torch). Releases
        the GIL while it waits.

        Raises ``TimeoutError`` (still running after ``timeout`` seconds; wait again later),
        ``ValueError`` (an input was refused: negative strides, past its allocation),
        ``JobFailedError`` (the worker was lost, or ``alloc`` raised: its exception is the
        ``__cause__``), ``WorkerError`` (the worker reported an error for the job),
        ``ArenaFullError`` (a result would pass the result arena's cap; a ``WorkerError``),
        ``UnknownWorkerError`` (the worker is not served); ``ValueError`` also for a negative
        ``timeout``.
        """
        results, rungs = self._native.wait(timeout)
        if self._results is None:
            owners = [r[5] for r in results]
            if self._torch:
                torch: Any = sys.modules["torch"]
                owners = [torch.from_dlpack(o) if isinstance(o, ArenaResult) else o for o in owners]
            self._results = owners
        self.input_rungs = list(rungs)
        self.result_rungs = [r[4] for r in results]
        self._inputs = None
        return list(self._results)

    def cancel(self) -> None:
        """Cancels the job. The worker is told (its result requests from now on are refused)
        and still finishes the job; ``wait`` then raises ``JobFailedError`` with ``reason ==
        "cancelled"``. Nothing the job held is reused before the worker finished it (its DONE
        completed) or died. The worker goes on taking jobs. A job that ended already is left
        as it is; cancelling twice is cancelling once.
        """
        self._native.cancel()

    def __repr__(self) -> str:
        return f"JobHandle(id={self.id}, worker={self.worker}, done={self.done})"


class Parent:
    """The parent side: spawns workers and lends them tensors.

    Every ``Parent`` of a process shares the one process parent and its pool, which
    ``install_pool`` made (or this makes, if nothing did: tensors torch allocated before
    cannot then be lent by pool pointer).

    Options (``ParentConfig``, which says what each means): the deadlines
    ``handoff_timeout``, ``stop_timeout``, ``handshake_timeout`` and ``frame_timeout``, in
    seconds (``None``: the process parent's; the defaults are 30, 5, 60, 5), and the result
    memory below. They are set by whichever of ``install_pool`` and ``Parent`` comes first in
    the process; a later value that differs is a ``ValueError`` naming the clash (``options``
    says what is in force).

    Result memory, also set by the first creation in the process (a later different value is
    a ``ValueError``): ``results="pool"`` (the default, the seed's way: each result is
    allocated in the shared pool, by ``torch.empty`` when torch tensors are lent, and
    exported to the worker; above the import limit it takes host staging) or
    ``results="arena"``: the result arena, parent-owned memory each worker maps once, so a
    result is an offset, with no export and no import limit (a result may be as large as the
    arena). ``arena_bytes`` is its first chunk and growth step (256 MiB by default, or the
    cap if smaller), ``arena_max_bytes`` its cap (None: half the device); the arena is made at the first
    result that goes to it. A result that would pass the cap fails its job with
    ``ArenaFullError`` naming the size and the cap; the parent and the worker go on. Arena
    results come back as torch tensors over an ``ArenaResult`` (``torch.from_dlpack``;
    without torch, the ``ArenaResult`` itself); the block goes back to the arena, ordered
    after the job's stream, once torch frees the tensor's storage (and every other tensor
    made from the same result). ``run``/``submit`` take ``results=`` per job: ``"pool"`` (or
    an ``alloc``) keeps the pool way for that job under an arena parent. The default stays
    the pool so that existing callers, which may keep results past a free on another stream
    or hold many at once, see no change.

    Thread-safe: share one ``Parent`` between threads. Jobs on different workers run at the
    same time; ``spawn``, ``stop``, ``pid``, ``canary_report`` and ``stats`` never wait for
    another thread's job; every wait releases the GIL.
    """

    def __init__(self, device: int = 0, **options: Unpack[ParentConfig]) -> None:
        """``device``: the pool's device ordinal. ``options``: the deadlines and the result
        memory (``results``, ``arena_bytes``, ``arena_max_bytes``), see ``ParentConfig``.

        Raises ``ValueError`` (a deadline not more than 0; an unknown ``results``; arena sizes
        without ``results="arena"``; a cap below ``arena_bytes``; another device, or other
        options, than the process's parent has) and ``PoolipcError`` (no usable driver: set
        ``POOLIPC_DRIVER=sim`` for the simulation; the pool cannot be installed).
        """
        config = parent_config(options, "Parent")
        self.device = _ordinal(device)
        self._native = _native.NativeParent(device, config)
        self._results: str = self._native.options()["results"]
        self.last_input_rungs: list[str] = []
        self.last_result_rungs: list[str] = []

    @property
    def driver(self) -> str:
        """Which driver the pool is on, in words (``the CUDA driver``, ``the SIMULATED
        driver ...``)."""
        return self._native.driver

    @property
    def simulated(self) -> bool:
        """Whether the process is on the simulated driver (``POOLIPC_DRIVER=sim``)."""
        return self._native.simulated

    @property
    def options(self) -> ParentOptions:
        """The process parent's options: ``device``, the deadlines in seconds, ``canary``,
        ``results`` (``pool`` or ``arena``), ``arena_bytes``, ``arena_max_bytes``,
        ``made_by``."""
        return self._native.options()

    def spawn(
        self,
        argv: Sequence[str | os.PathLike[str]],
        env: Mapping[str, str] | None = None,
        env_allowlist: Iterable[str] | None = None,
    ) -> int:
        """Start ``argv`` as a worker (it inherits the socket; with ``POOLIPC_DRIVER=sim`` also
        the simulated machine) and shake hands; returns the worker id. The worker's
        ``POOLIPC_DEVICE`` is this process's device ordinal unless ``env`` sets it: set it to
        ``"parent"`` when the worker's ``CUDA_VISIBLE_DEVICES`` differs, and it finds the
        device by UUID.

        The worker inherits this process's whole environment unless ``env_allowlist`` is
        given: then it gets only the variables named there, plus ``env``, plus what every
        worker keeps (``PATH``, ``HOME``, ``TMPDIR``, ``LANG``, ``LD_LIBRARY_PATH``,
        ``PYTHONPATH`` and every ``POOLIPC_*``, ``CUDA_*`` and ``LC_*``). Give a list (even an
        empty one) to keep secrets such as API keys from a worker you do not trust.

        Raises ``TypeError`` for an ``argv`` that is a string (give a list), or an
        ``env_allowlist`` that is one; ``ValueError`` for an empty ``argv``; ``PoolipcError``
        when the program cannot be started, exits, or is refused during the handshake or the
        canary battery (the message says why).
        """
        if isinstance(argv, (str, bytes)):
            raise TypeError(
                f"poolipc: argv must be a list of arguments, not a {type(argv).__name__} "
                f"({argv!r}); write [{argv!r}]"
            )
        allow = None
        if env_allowlist is not None:
            if isinstance(env_allowlist, (str, bytes)):
                raise TypeError(
                    "poolipc: env_allowlist must be a list of variable names, not a "
                    f"{type(env_allowlist).__name__} ({env_allowlist!r})"
                )
            allow = [str(n) for n in env_allowlist]
        return self._native.spawn([os.fspath(a) for a in argv], env, allow)

    def spawn_python(
        self,
        script: str | os.PathLike[str],
        *args: str,
        env: Mapping[str, str] | None = None,
        env_allowlist: Iterable[str] | None = None,
    ) -> int:
        """Start ``python script args...`` with this interpreter as a worker (see ``spawn``)."""
        return self.spawn([sys.executable, script, *args], env, env_allowlist)

    def listen(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        token: str | None = None,
        once: bool = False,
    ) -> NativeListener:
        """Listen for workers this process does not start (pyisolate's children, a service
        manager's): returns a ``Listener`` on a Unix socket in ``directory`` (it must be ours
        and mode 0700; None: a fresh private directory under ``$XDG_RUNTIME_DIR`` or the
        temporary directory). Give the worker process ``listener.env()`` (``POOLIPC_CONNECT``
        = ``listener.path``, plus the simulated machine on ``POOLIPC_DRIVER=sim``); it calls
        ``poolipc.Worker.connect()``. A background thread accepts each connection, checks that
        the peer runs as our uid (others are refused before the handshake and listed in
        ``listener.refused``), shakes hands and runs the canary battery; ``listener.accept(
        timeout=None)`` returns the next accepted worker's id, for ``run``/``submit``/``stop``
        as with ``spawn``. ``listener.close()`` stops accepting (workers taken go on).

        The uid check keeps other users out, not other processes of ours. ``token`` (32 ASCII
        characters, e.g. ``uuid.uuid4().hex``) makes the listener a capability: every
        connection must present it first (``listener.env()`` carries it as
        ``POOLIPC_CONNECT_TOKEN``, which ``Worker.connect()`` sends), or it is dropped before
        the parent sends anything, the pool FD included (``listener.refused``,
        ``listener.refused_count``). ``once=True``: the first connection with the token is
        the only one; the listener then closes.

        Raises ``ValueError`` for a directory that is not private, a socket path that is
        taken by something else, or a token that is not 32 ASCII characters;
        ``PoolipcError`` when the socket cannot be made.
        ``accept`` raises ``TimeoutError`` when no worker came in time and ``PoolipcError``
        for one that connected but was not taken (its handshake or canaries failed).
        """
        return self._native.listen(
            None if directory is None else os.fspath(directory), token=token, once=once
        )

    def pid(self, worker: int) -> int | None:
        """The worker's process id (None once it is stopped or lost); never waits for a job."""
        return self._native.pid(worker)

    def workers(self) -> list[int]:
        """The ids of the workers this parent serves."""
        return list(self._native.workers())

    def canary_report(self, worker: int) -> str | None:
        """The canary battery's report on the worker, in words (None for a worker this parent
        does not serve). Never waits for a job."""
        return self._native.canary_report(worker)

    def stats(self) -> ParentStats:
        """Counters: workers connected and lost, jobs submitted, completed and failed, tensors
        by pool pointer and by host staging, results in the arena and inputs copied into it,
        arena slices lent and results carved out of them. Never waits for a job."""
        return self._native.stats()

    def set_arena_slice_bytes(self, nbytes: int) -> None:
        """Lends every job submitted from now on a slice of ``nbytes`` of the result arena
        (0, the default: none). A worker that learns its results' shapes late then carves
        them out of the slice with no round trip to the parent (``request_results`` does it
        by itself, and asks as before when they do not fit); the unused rest goes back when
        the job ends. Needs ``results="arena"``: ``ValueError`` otherwise. The counters are in
        ``stats()`` (``arena_slices_lent``, ``arena_results_carved``)."""
        self._native.set_arena_slice_bytes(nbytes)

    def arena_stats(self) -> ArenaStats:
        """The result arena's figures, after freeing the blocks given back whose work is done:
        ``enabled``, ``created``, ``capacity``, ``used``, ``largest_free``, ``live_blocks``,
        ``pending_frees``, ``chunks``, ``max_bytes`` and ``results_out`` (arena results whose
        block has not gone back: the ``ArenaResult`` objects and the tensors made from them).
        ``PoolipcError`` when the driver cannot be reached."""
        return self._native.arena_stats()

    def submit(
        self,
        worker: int,
        inputs: Iterable[Any],
        *,
        stream: int | _HasCudaStream | None = None,
        alloc: Allocator | None = None,
        results: str | None = None,
        read_only: bool | Iterable[bool] = False,
    ) -> JobHandle:
        """Lend ``inputs`` to ``worker`` and return at once; the ``JobHandle``'s ``wait()``
        gives the results. Arguments as for ``run``. The inputs must not be written until the
        job ended (the handle keeps them alive until then).

        A tensor that cannot be lent (negative strides, a wrong dtype, a CPU tensor) raises
        ``ValueError`` here; one that runs past its allocation raises it from ``wait``. Either
        way the worker is untouched. An object that is no tensor raises ``TypeError``; a
        worker this parent does not serve, ``UnknownWorkerError``; ``results`` that is not
        ``"pool"`` or ``"arena"``, ``"arena"`` with an ``alloc``, or ``"arena"`` when the
        process's parent was made without the arena, ``ValueError``.
        """
        if results is not None and results not in _RESULTS:
            raise ValueError(f'poolipc: results={results!r} is not a result memory; use "pool" or "arena"')
        if results == "arena" and alloc is not None:
            raise ValueError('poolipc: results="arena" takes no alloc (an allocator makes pool results)')
        if results == "arena" and self._results != "arena":
            raise ValueError(
                'poolipc: results="arena" needs the process\'s parent made with results="arena" '
                "(pass it to install_pool() or the first Parent(); the arena is set once per process)"
            )
        to_arena = alloc is None and (results or self._results) == "arena"
        inputs = list(inputs)
        specs = [_describe(x) for x in inputs]
        flags = _read_only_flags(read_only, len(inputs))
        torch_mode = any(_is_torch_tensor(x) for x in inputs) or (
            alloc is None and not inputs and "torch" in sys.modules
        )
        torch: Any = sys.modules.get("torch")
        torch_stream: Any = None
        raw_stream: int
        if stream is None:
            if torch_mode:
                torch_stream = torch.cuda.current_stream(self.device)
                raw_stream = int(torch_stream.cuda_stream)
            else:
                raw_stream = 0
        elif not isinstance(stream, int):
            handle = getattr(stream, "cuda_stream", None)
            if not isinstance(handle, int):
                raise TypeError(
                    f"poolipc: stream must be a stream handle (an int) or a torch stream, not "
                    f"{type(stream).__name__}"
                )
            torch_stream = stream
            raw_stream = handle
        else:
            raw_stream = stream
            if torch_mode:
                dev = torch.device("cuda", self.device)
                torch_stream = (
                    torch.cuda.default_stream(dev)
                    if raw_stream == 0
                    else torch.cuda.ExternalStream(raw_stream, device=dev)
                )
        native_alloc: Callable[[str, list[int], int, int], tuple[int, object]] | None = None
        if alloc is None and not to_arena and not torch_mode and self._results == "arena":
            # Pool results for this job under an arena parent: DeviceBuffers from the pool.
            native = self._native

            def pool_alloc(dtype: str, shape: tuple[int, ...], nbytes: int) -> DeviceBuffer:
                return native.alloc(nbytes, raw_stream, dtype, list(shape))

            alloc = pool_alloc
        if alloc is None and torch_mode and not to_arena:
            dev = torch.device("cuda", self.device)

            # nbytes is for other allocators.
            def torch_alloc(dtype: str, shape: tuple[int, ...], nbytes: int) -> Any:  # noqa: ARG001
                return torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=dev)

            alloc = torch_alloc

        if alloc is not None:
            user_alloc = alloc

            def native_alloc(
                dtype: str, shape: list[int], nbytes: int, _stream: int
            ) -> tuple[int, object]:
                # Runs on the parent's IO thread (it took the GIL): torch's current stream
                # there is the default one, so the job's stream is made current for torch.
                if torch_stream is not None:
                    with torch.cuda.stream(torch_stream):
                        t = user_alloc(dtype, tuple(shape), nbytes)
                else:
                    t = user_alloc(dtype, tuple(shape), nbytes)
                ptr = t.data_ptr() if callable(getattr(t, "data_ptr", None)) else int(t.ptr)
                return (int(ptr), t)

        native_handle = self._native.submit(worker, specs, raw_stream, native_alloc, inputs, flags)
        return JobHandle(native_handle, inputs, torch_results=to_arena and torch_mode)

    def run(
        self,
        worker: int,
        inputs: Iterable[Any],
        *,
        stream: int | _HasCudaStream | None = None,
        alloc: Allocator | None = None,
        results: str | None = None,
        read_only: bool | Iterable[bool] = False,
    ) -> list[Any]:
        """Lend ``inputs`` to ``worker``, serve its result requests, return its results:
        ``submit(...).wait()``.

        ``inputs``: torch CUDA tensors (pointer, dtype, shape and strides are taken from
        them; views with offsets and non-contiguous tensors go as they are, described by
        their strides; negative strides are refused) or ``TensorRef``\\ s. Tensors of the
        shared pool go by pool pointer; a VMM allocation made with the POSIX FD handle type
        by its handle (``vmm handle``: no copy, mapped once per worker); any other device
        memory of the parent's device by arena copy (one device-to-device copy), host
        staging when that cannot be made.

        ``read_only``: True when the worker only reads every input, or one flag per input.
        By default (False) no write of the worker's is lost: an input that crossed by a copy
        (arena copy, host staging) is copied back into the tensor after the job, on
        ``stream`` after its wait on DONE. A read-only input is not copied back, and the
        worker sees it read-only: its ``View.read_only`` is True, ``write_bytes`` raises,
        DLPack exports it read-only (torch ignores that flag), and an arena-copy input is
        mapped read-only in the worker, so a kernel that writes it faults and fails the job.
        A read-only input on the pool pointer is the tensor itself: a write the worker makes
        anyway lands in it; by VMM handle the worker views it through a read-only mapping
        (a write faults); on host staging it changes only the worker's private copy.
        A flag count that differs from the inputs' is a ``ValueError``.

        ``stream``: the stream READY is recorded on (it never waits on a worker's event: the
        job ends once the worker's DONE completed, as the parent sees on the host);
        default: torch's current stream when torch tensors are lent, else the legacy default
        stream (0).

        ``alloc(dtype, shape, nbytes) -> tensor``: makes each result; default: ``torch.empty``
        on this device when torch is imported and a torch tensor was lent, else a
        ``DeviceBuffer`` from the pool. It is called on the parent's IO thread (holding the
        GIL), with ``stream`` as torch's current stream; it must not wait on this parent (no
        ``run``, ``wait``, ``spawn`` or ``stop`` inside it). If it raises, the job fails with
        ``JobFailedError`` whose ``__cause__`` is its exception. Returned tensors are ordinary
        torch tensors from the pool; the worker's DONE has completed, so they may be used at
        once on it.

        ``results``: where this job's results go when no ``alloc`` is given: ``"pool"`` (as
        above) or ``"arena"`` (the result arena: torch tensors made by ``torch.from_dlpack``
        over ``ArenaResult``\\ s, or the ``ArenaResult``\\ s without torch; see the class);
        None: the process parent's ``results`` (``options["results"]``, ``"pool"`` unless it
        was made with ``"arena"``). An ``alloc`` always means pool results.

        ``last_input_rungs``/``last_result_rungs`` say how the last job of this object
        crossed; with several threads, use ``submit`` and the handle's ``input_rungs``.

        Raises what ``submit`` and ``JobHandle.wait`` raise: ``ValueError`` (an input that
        cannot be lent), ``TypeError`` (an object that is no tensor), ``UnknownWorkerError``,
        ``JobFailedError`` (the worker was lost, or ``alloc`` raised), ``WorkerError`` (the
        worker reported an error for the job), ``ArenaFullError`` (a result would pass the
        arena's cap; the parent and the worker go on), ``ValueError`` (a bad ``results``).
        """
        handle = self.submit(
            worker, inputs, stream=stream, alloc=alloc, results=results, read_only=read_only
        )
        out = handle.wait()
        self.last_input_rungs = handle.input_rungs or []
        self.last_result_rungs = handle.result_rungs or []
        return out

    def stop(self, worker: int) -> int | None:
        """Tell the worker to stop; wait for it at most ``stop_timeout``, then kill it; reap
        it. Returns its exit code (None when it had to be killed). Its jobs in flight raise
        ``JobFailedError``; other workers' jobs go on. ``UnknownWorkerError`` for a worker
        this parent does not serve."""
        return self._native.stop(worker)

    # Raw memory, for tools and tests without torch.
    def alloc(
        self,
        nbytes: int,
        *,
        dtype: str = "uint8",
        shape: Iterable[int] | None = None,
        stream: int = 0,
        shared: bool = True,
    ) -> DeviceBuffer:
        """``nbytes`` of device memory: from the shared pool (lent by pool pointer), or with
        ``shared=False`` from the device's default pool (lent by arena copy, or host staging
        where the worker has no arena). ``shape``
        (default: ``nbytes`` over the dtype's size, in one dimension) must cover ``nbytes``
        exactly.

        Raises ``ValueError`` (an unknown dtype; ``nbytes`` of 0; a shape whose elements do
        not take ``nbytes``) and ``PoolipcError`` (the driver refused: out of memory).
        """
        return self._native.alloc(nbytes, stream, dtype, None if shape is None else list(shape), shared)

    def write(self, ptr: int, data: bytes, *, stream: int | None = None) -> None:
        """Copy ``data`` to device address ``ptr`` and wait for it: without ``stream`` on the
        legacy stream, with it on ``stream``, after the work queued there. ``PoolipcError``
        when the driver refuses, ``ValueError`` for a ``stream`` that is none of this
        process."""
        self._native.write(int(ptr), bytes(data), stream)

    def fill(self, ptr: int, nbytes: int, value: int, *, stream: int = 0) -> None:
        """Set ``nbytes`` bytes at device address ``ptr`` to ``value``, queued on ``stream``
        (GPU work, torch-free: it returns before the bytes are set). ``PoolipcError`` when
        the driver refuses, ``ValueError`` for a ``stream`` that is none of this process."""
        self._native.fill(int(ptr), int(nbytes), int(value), stream)

    def read(self, ptr: int, nbytes: int, *, stream: int | None = None) -> bytes:
        """Copy ``nbytes`` from device address ``ptr`` and wait for it: without ``stream`` on
        the legacy stream, with it on ``stream``, after the work queued there (a job's
        results: the stream the job was submitted on). ``PoolipcError`` when the driver
        refuses, ``MemoryError`` when no host buffer of that size can be had, ``ValueError``
        for a ``stream`` that is none of this process."""
        return bytes(self._native.read(int(ptr), int(nbytes), stream))

    def synchronize(self, stream: int = 0) -> None:
        """Wait on the host for ``stream``'s work. ``PoolipcError`` when the driver refuses,
        ``ValueError`` for a ``stream`` that is none of this process."""
        self._native.synchronize(stream)


def _worker_device(device: int | str | None) -> tuple[int | None, bool]:
    """``Worker``'s ``device`` as the native worker takes it: ``(ordinal or None for the
    parent's device, any)``. Unset: ``POOLIPC_DEVICE``, else 0."""
    if device is None:
        device = os.environ.get("POOLIPC_DEVICE", "0")
    text = str(device)
    if text == "parent":
        return None, False
    try:
        return _ordinal(int(text.removeprefix("any:"))), text.startswith("any:")
    except (ValueError, TypeError):
        raise ValueError(f"poolipc: device {device!r} is not an ordinal, 'parent' or 'any:N'") from None


class Worker:
    """A worker process's side. Iterate it for jobs; use each job as a context manager::

        worker = poolipc.Worker()
        for job in worker:
            with job:
                x = torch.from_dlpack(job.inputs[0])
                (out,) = job.request_results([("float32", tuple(x.shape))])
                torch.from_dlpack(out).copy_(x * 2)

    Leaving the ``with`` block finishes the job (DONE after every stream that took a view by
    DLPack, imports freed, ACK) or, on an exception, fails it with the exception's text. Views
    and tensors made from them must not be used after that: the views raise
    ``ExpiredViewError``; tensors made from them point at memory the parent owns again.

    A write to an input reaches the parent's tensor on every rung (copies come back after the
    job) unless the parent lent it read-only: then ``view.read_only`` is True,
    ``write_bytes`` raises, ``__cuda_array_interface__`` and the versioned DLPack capsule say
    read-only, and an arena-copy input is mapped read-only (a kernel's write faults). torch
    ignores DLPack's read-only flag (it has no read-only tensors), so with torch check
    ``read_only`` and clone before writing in place.
    """

    def __init__(self, device: int | str | None = None) -> None:
        """``device``: this process's ordinal of the parent's device; ``"parent"`` for whichever
        of its devices has the parent's UUID (ordinals differ when the two processes'
        ``CUDA_VISIBLE_DEVICES`` differ); ``"any:N"`` to work on ordinal N wherever the
        parent's pool is (by peer access where the devices reach each other, else every tensor
        by host staging). Unset: ``POOLIPC_DEVICE``, else 0. ``self.device`` is the ordinal it
        works on.

        Raises ``ValueError`` for a ``device`` that is no ordinal, ``"parent"`` or
        ``"any:N"``; ``PoolipcError`` when this process was not spawned by a poolipc parent,
        the handshake fails, or no device fits (the message says why).
        """
        ordinal, any_device = _worker_device(device)
        self._native = _native.NativeWorker(ordinal, any=any_device)
        self.device = self._native.device

    @classmethod
    def connect(
        cls,
        path: str | os.PathLike[str] | None = None,
        device: int | str | None = None,
        token: str | None = None,
    ) -> Worker:
        """The worker side of a process its parent did not start: connect to the parent's
        listening socket at ``path`` (``Parent.listen``; None: ``POOLIPC_CONNECT`` from the
        environment, which ``listener.env()`` sets), shake hands, and take jobs as any
        worker does. ``device`` as for ``Worker()``. ``token``: the listener's token, sent
        first (None: ``POOLIPC_CONNECT_TOKEN`` from the environment, if set).

        Raises ``ValueError`` for no path (none given and ``POOLIPC_CONNECT`` unset), a path
        too long for a Unix socket, or a bad ``device``; ``ConnectError`` when nothing
        listens there (no such socket, the listener closed, the parent gone) or the listener
        runs as another user; ``PoolipcError`` when the handshake fails or no device fits.
        """
        if path is None:
            path = os.environ.get(CONNECT_ENV)
            if not path:
                raise ValueError(
                    f"poolipc: Worker.connect() without a path needs {CONNECT_ENV} in the "
                    "environment (the parent's listener.env() sets it)"
                )
        ordinal, any_device = _worker_device(device)
        self = cls.__new__(cls)
        if token is None:
            token = os.environ.get(CONNECT_TOKEN_ENV) or None
        self._native = _native.NativeWorker.connect(os.fspath(path), ordinal, any_device, token)
        self.device = self._native.device
        return self

    @property
    def stream(self) -> int:
        """The jobs' stream (it waited on READY; DONE is recorded on it)."""
        return self._native.stream

    @property
    def simulated(self) -> bool:
        """Whether this worker is on the simulated driver (its parent was)."""
        return self._native.simulated

    def next_job(self, *, concurrent: bool = False) -> Job | None:
        """The next job (waits for it), or None when the parent said goodbye or went away.
        ``PoolipcError`` when the worker was closed, or a job is still open and
        ``concurrent`` is False. With ``concurrent=True`` several jobs may be open at once,
        each finished (or leased, ``Job.lease()``) on its own, in any order: what a
        pyisolate child does, whose tensors arrive one RPC message at a time."""
        return self._native.next_job(concurrent)

    def auto_take(self) -> None:
        """From now on the worker's thread takes jobs as they arrive, between the commands of
        the jobs it holds open, and ``take`` hands them out (``next_job`` is refused after
        this). For a worker whose code does not sit in a job loop (a pyisolate child, which
        learns of a job from an RPC message): the parent's canary battery, which runs while
        the parent accepts the worker, is answered as it arrives."""
        self._native.auto_take()

    def take(self, job: int | None = None, timeout: float | None = None) -> Job | None:
        """A job taken in the background (after ``auto_take``): the one with id ``job``, or
        the first to arrive when None; others stay queued. Waits at most ``timeout`` seconds
        (None: until it comes). None when the parent said goodbye or went away. Raises
        ``TimeoutError`` when it did not come in time, ``PoolipcError`` when taking jobs
        failed, ``ValueError`` for a negative timeout."""
        return self._native.take(job, timeout)

    def __iter__(self) -> Iterator[Job]:
        """The jobs, until the parent says goodbye."""
        while True:
            job = self.next_job()
            if job is None:
                return
            yield job

    def close(self) -> None:
        """Stop the worker's thread (an open job is finished first); ``next_job`` raises
        ``PoolipcError`` afterwards."""
        self._native.close()
