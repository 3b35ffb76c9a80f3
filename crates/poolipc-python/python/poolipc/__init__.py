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

``torch_sharing``: torch.multiprocessing under ``backend:cudaMallocAsync``. After
``install_pool()`` (before torch) and ``poolipc.torch_sharing.enable()``, CUDA tensors put on
``mp.Queue``, ``mp.Pipe``, ``mp.Pool`` or passed to ``Process`` cross to the other process
over the pool without a copy (``SharedMapping`` is the torch-free form of a received share).

Workers someone else starts (pyisolate's children): ``Parent.listen()`` gives a ``Listener``
whose ``env()`` (``POOLIPC_CONNECT``) goes to the child, which calls ``Worker.connect()``; the
host learns the worker's id from ``listener.accept(timeout)``. ``poolipc.pyisolate`` builds
pyisolate's tensor transport on it.
"""

from __future__ import annotations

from typing import Final, NamedTuple

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
    SharedMapping,
    SimViolationError,
    UnknownWorkerError,
    View,
    WorkerError,
    mem_get_info,
    memory_stats,
    mps_status,
    reset_peak_memory_stats,
)
from ._types import (
    ArenaStats,
    DType,
    InstallInfo,
    MemoryStats,
    MpsStatus,
    ParentConfig,
    ParentOptions,
    ParentStats,
)
from ._parent import Allocator, JobHandle, Parent, TensorRef, wait_any
from ._pool import (
    ALLOC_CONF,
    ASYNC_BACKEND,
    _backend_choice,
    _hook_torch,
    _patch_torch_empty_cache,
    _patch_torch_memory_stats,
    empty_cache,
    install_pool,
    log,
    start_mps,
)
from ._worker import Worker
from . import torch_sharing


class SimReport(NamedTuple):
    """What the simulated GPU's race checker found (``sim_report``)."""

    text: str
    """The report in words, with the seed that replays the run."""
    seed: int
    """Run again with ``POOLIPC_SIM_SEED`` set to it to replay the same interleaving."""
    violations: list[str]
    """One sentence per violation, naming both calls, their streams and processes; empty
    when every rule was kept."""


def sim_report() -> SimReport | None:
    """On the simulated driver (``POOLIPC_DRIVER=sim``), everything its race checker found
    so far, in this process or any worker: streams that never waited for READY, read-only
    inputs written, results written after DONE, memory used after its job or its free. None
    on the GPU, where nothing is checked, or before the process's parent was made. What it
    returns is not summarized again when the process exits. See ``poolipc.testing`` for a
    pytest fixture that fails a test on any violation."""
    got = _native.sim_report()
    if got is None:
        return None
    text, seed, violations = got
    return SimReport(text, seed, list(violations))

__all__ = [
    "__version__",
    "install_pool",
    "memory_stats",
    "mem_get_info",
    "reset_peak_memory_stats",
    "empty_cache",
    "Parent",
    "JobHandle",
    "wait_any",
    "Worker",
    "Job",
    "View",
    "DeviceBuffer",
    "ArenaResult",
    "SharedMapping",
    "torch_sharing",
    "Listener",
    "LeaseHold",
    "TensorRef",
    "DType",
    "PoolipcError",
    "JobFailedError",
    "WorkerError",
    "UnknownWorkerError",
    "ArenaFullError",
    "ExpiredViewError",
    "ContextLostError",
    "SimViolationError",
    "SimReport",
    "sim_report",
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

Listener = NativeListener
"""What ``Parent.listen`` returns: ``path``, ``env()``, ``accept(timeout)``, ``refused``,
``close()``."""

CONNECT_ENV: Final = _native.CONNECT_ENV
CONNECT_TOKEN_ENV: Final = _native.CONNECT_TOKEN_ENV
"""``POOLIPC_CONNECT``: where a worker started by someone else finds its parent's listener."""
