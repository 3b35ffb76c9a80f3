"""The native part of ``poolipc`` (PyO3, abi3): the process's shared pool and parent, worker
side, views. The package ``poolipc`` wraps it for torch; use that unless you need the raw
calls. Kept in step with ``crates/poolipc-python/src`` by ``stubtest`` in the test suite."""

import os
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Final, final

from ._types import (
    ArenaStats,
    DType,
    MemoryStats,
    MpsStatus,
    NativeAllocator,
    NativeInstallInfo,
    NativeResult,
    ParentConfig,
    ParentOptions,
    ParentStats,
)

__all__ = [
    "_install",
    "is_installed",
    "empty_cache",
    "mem_get_info",
    "memory_stats",
    "probe_dump",
    "probe_mark",
    "wait_any",
    "reset_peak_memory_stats",
    "NativeParent",
    "DeviceBuffer",
    "ArenaResult",
    "SharedMapping",
    "SimViolationError",
    "sim_report",
    "_share",
    "_open",
    "_kick",
    "_release",
    "_stats",
    "_forget_kept",
    "_interpreter_exiting",
    "_child_env",
    "_memcpy_dtoh",
    "_memcpy_htod",
    "_pool_device",
    "NativeJobHandle",
    "NativeWorker",
    "Job",
    "View",
    "LeaseHold",
    "NativeListener",
    "PoolipcError",
    "ConnectError",
    "JobFailedError",
    "WorkerError",
    "UnknownWorkerError",
    "ArenaFullError",
    "ExpiredViewError",
    "ContextLostError",
    "MpsError",
    "start_mps",
    "mps_status",
    "DRIVER_ENV",
    "CONNECT_ENV",
    "CONNECT_TOKEN_ENV",
    "__version__",
]

DRIVER_ENV: Final[str]
"""The environment variable that picks the driver: ``sim``, ``auto`` or ``cuda`` (the default)."""
__version__: Final[str]
"""The package's version (the Rust crate's)."""
CONNECT_ENV: Final[str]
"""The environment variable a worker reads a listener's path from (``POOLIPC_CONNECT``)."""
CONNECT_TOKEN_ENV: Final[str]
"""The environment variable a worker reads a listener's token from (``POOLIPC_CONNECT_TOKEN``)."""

class PoolipcError(RuntimeError):
    """A poolipc operation failed; the message names the call and the reason."""

class JobFailedError(PoolipcError):
    """A job failed because its worker was lost (or the result allocator raised)."""

    worker: int | None
    reason: str | None
    detail: str | None

class WorkerError(JobFailedError):
    """The worker reported an error for the job; it is alive and serves the next job."""

    message: str

class UnknownWorkerError(PoolipcError, KeyError):
    """A worker id this parent does not know, or no longer serves."""

    worker: int

class ArenaFullError(WorkerError, MemoryError):
    """A result would pass the result arena's cap; the message names the size and the cap."""

class ExpiredViewError(PoolipcError):
    """A view, a result buffer or a freed DeviceBuffer was used after its memory went back."""

class ConnectError(PoolipcError):
    """A worker could not reach a parent's listening socket (``Worker.connect``)."""

class ContextLostError(PoolipcError):
    """This process's CUDA context is lost (under MPS, possibly a worker's GPU fault); the
    parent refuses all further work: restart the process."""

class SimViolationError(PoolipcError):
    worker: int
    job: int
    seed: int
    violations: list[str]

def sim_report() -> tuple[str, int, list[str]] | None: ...

class MpsError(PoolipcError):
    """``start_mps`` refused (not acknowledged, not installed, too late, another daemon) or
    the daemon did not start."""

def start_mps(
    *, accept_shared_gpu_faults: bool = False, control: str | os.PathLike[str] | None = None
) -> str:
    """Starts a private MPS daemon and makes this process its client; the pipe directory."""

def mps_status() -> MpsStatus:
    """What this machine and process say about MPS, without touching CUDA."""

def _install(device: int = 0, options: ParentConfig | None = None) -> NativeInstallInfo:
    """Installs the shared pool by creating the process's parent (see ``install_pool``);
    ``options`` has every key of ``ParentConfig`` (``poolipc._types.parent_config``)."""

def is_installed() -> bool:
    """Whether a pool is installed in this process."""

def empty_cache() -> int:
    """Trims the shared pool after a context synchronize; the bytes given back."""

def mem_get_info() -> tuple[int, int]:
    """The device's free and total memory in bytes (``cuMemGetInfo``)."""

def wait_any(handles: list[NativeJobHandle], timeout: float | None = None) -> int:
    """The index of one of ``handles`` that has ended, waiting (GIL released) until one has;
    ``TimeoutError`` after ``timeout`` seconds, ``ValueError`` for none or a bad timeout."""

def probe_mark(label: str) -> None:
    """Records ``label`` (``rt.begin``, ``rt.synced``, ``user.begin``, ``user.end``) when
    ``POOLIPC_PROBE`` is set; ``ValueError`` for another label."""

def probe_dump() -> None:
    """Writes this process's probe marks so far to a new file under ``POOLIPC_PROBE``."""

def memory_stats() -> MemoryStats:
    """The shared pool's true figures; ``PoolipcError`` when no pool is installed."""

def reset_peak_memory_stats() -> None:
    """Restarts the shared pool's high marks (``used_high``, ``reserved_high``) from the
    current figures; ``PoolipcError`` when no pool is installed or the driver refuses."""

@final
class DeviceBuffer:
    """Device memory, freed when the object dies or ``free()`` is called."""

    @property
    def ptr(self) -> int:
        """The device address; ``ExpiredViewError`` once freed."""
    @property
    def nbytes(self) -> int:
        """Its size in bytes."""
    @property
    def dtype(self) -> DType:
        """The dtype: a ``DType`` (a ``str`` enum, equal to its name)."""
    @property
    def shape(self) -> tuple[int, ...]:
        """The shape."""
    @property
    def shared(self) -> bool:
        """From the shared pool (True) or the device's default pool."""
    def data_ptr(self) -> int:
        """Same as ``ptr``."""
    def free(self) -> None:
        """Frees the memory now."""

@final
class SharedMapping:
    """A received share: ``nbytes`` of another process's pool memory mapped here at ``ptr``;
    valid while the object lives, released (the import freed, the sender told) when it dies
    or ``release()`` is called."""

    @property
    def ptr(self) -> int:
        """The device address in this process."""
    @property
    def nbytes(self) -> int:
        """Its size in bytes."""
    @property
    def device(self) -> int:
        """The device ordinal it is mapped on."""
    @property
    def released(self) -> bool:
        """Whether it was released."""
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """``nbytes`` unsigned bytes at ``ptr`` (version 3, no stream)."""
    def read(self, offset: int = 0, n: int | None = None) -> bytes:
        """Copies ``n`` bytes (all by default) from ``offset`` to the host."""
    def write(self, data: bytes, offset: int = 0) -> None:
        """Copies ``data`` from the host to ``offset``."""
    def release(self) -> None:
        """Lets go now; idempotent."""

def _share(
    ptr: int, nbytes: int, device: int | None, keep: object, stream: int | None = None
) -> tuple[bytes, int, bytes, bool | None] | str: ...
def _open(handle: bytes, offset: int, nbytes: int, ref: bytes | None, device: int) -> SharedMapping: ...
def _kick(device: int, stream: int) -> bool: ...
def _release(ref: bytes) -> None: ...
def _stats() -> dict[str, Any]: ...
def _forget_kept() -> int: ...
def _interpreter_exiting() -> None: ...
def _child_env() -> tuple[str, str] | None: ...
def _memcpy_dtoh(ptr: int, n: int) -> bytes: ...
def _memcpy_htod(ptr: int, data: bytes) -> None: ...
def _pool_device() -> int: ...

@final
class ArenaResult:
    """A result in the parent's result arena; its block goes back once it and every DLPack
    tensor made from it are gone."""

    @property
    def ptr(self) -> int:
        """The device address of element 0."""
    @property
    def nbytes(self) -> int:
        """Its size in bytes."""
    @property
    def dtype(self) -> DType:
        """The dtype: a ``DType`` (a ``str`` enum, equal to its name)."""
    @property
    def shape(self) -> tuple[int, ...]:
        """The shape."""
    @property
    def rung(self) -> str:
        """How it crossed: ``arena``."""
    @property
    def device(self) -> int:
        """The device ordinal."""
    @property
    def stream(self) -> int:
        """The job's stream."""
    @property
    def live_exports(self) -> int:
        """DLPack tensors made from it that are still alive."""
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """``__cuda_array_interface__`` version 3."""
    def data_ptr(self) -> int:
        """Same as ``ptr``."""
    def __dlpack_device__(self) -> tuple[int, int]:
        """``(kDLCUDA, device)``."""
    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> object:
        """A DLPack capsule over the result (no copy) that shares its block."""

@final
class NativeJobHandle:
    """A job submitted with ``NativeParent.submit``."""

    @property
    def id(self) -> int:
        """The job's id."""
    @property
    def worker(self) -> int:
        """The worker it runs on."""
    @property
    def done(self) -> bool:
        """Whether the job has ended."""
    def wait(self, timeout: float | None = None) -> tuple[list[NativeResult], list[str]]:
        """Waits for the job: ``(results, input_rungs)`` or its typed error."""
    def cancel(self) -> None:
        """Cancels the job: it fails with ``JobFailedError`` (``reason == "cancelled"``)."""

@final
class NativeParent:
    """The parent side of poolipc for Python (the process's one parent, shared)."""

    def __new__(cls, device: int = 0, options: ParentConfig | None = None) -> NativeParent:
        """The process's parent, made (and the pool installed) if nothing did, with
        ``options`` (every key of ``ParentConfig``; None: the defaults). Set once per
        process."""
    @property
    def device(self) -> int:
        """The pool's device ordinal."""
    @property
    def driver(self) -> str:
        """Which driver the pool is on, in words."""
    @property
    def simulated(self) -> bool:
        """Whether the process is on the simulated driver."""
    def options(self) -> ParentOptions:
        """The process parent's options."""
    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        env_allowlist: Sequence[str] | None = None,
        isolated: bool | None = None,
    ) -> int:
        """Spawns ``argv`` as a worker; returns its id. With ``env_allowlist``, the worker
        inherits only those variables (plus ``env`` and what poolipc keeps); ``isolated``
        chooses its trust (None: the parent's ``isolated`` option)."""
    def listen(
        self,
        directory: str | os.PathLike[str] | None = None,
        token: str | None = None,
        once: bool = False,
    ) -> NativeListener:
        """Listens for workers this parent does not start (with ``token``: only those that
        present it; with ``once``: one)."""
    def pid(self, worker: int) -> int | None:
        """The worker's process id, or None."""
    def workers(self) -> list[int]:
        """The ids of the workers this parent serves."""
    def canary_report(self, worker: int) -> str | None:
        """The canary battery's report on the worker, in words."""
    def stats(self) -> ParentStats:
        """The parent's counters."""
    def lower_import_limit(self, max_chunks: int) -> None:
        """Lowers the pool-pointer import limit to ``max_chunks`` chunks of 32 MiB."""
    def set_arena_slice_bytes(self, nbytes: int) -> None:
        """Lends each job placed from now on an arena slice of ``nbytes`` (0: none)."""
    def arena_stats(self) -> ArenaStats:
        """The result arena's figures, after freeing blocks whose work is done."""
    def submit(
        self,
        worker: int,
        inputs: Sequence[object],
        stream: int = 0,
        alloc: NativeAllocator | None = None,
        keep: object | None = None,
        read_only: Sequence[bool] | None = None,
        wait_first: bool = False,
    ) -> NativeJobHandle:
        """Lends ``inputs`` (CUDA torch tensors, ``TensorRef``\\ s, objects with ``ptr`` or
        ``data_ptr()``, ``dtype``, ``shape``, ``strides``) to ``worker`` and returns a handle
        at once. Without ``alloc``, results go to the process parent's result memory (pool or
        arena). ``read_only``: one flag per input (None: all writable; writable copies come
        back after the job). ``wait_first``: waits for the job once (50 ms at most) in the
        same release of the GIL as the submit; the handle then holds the answer if it came."""
    def run(
        self,
        worker: int,
        inputs: Sequence[object],
        stream: int = 0,
        alloc: NativeAllocator | None = None,
        read_only: Sequence[bool] | None = None,
    ) -> tuple[list[NativeResult], list[str]]:
        """``submit`` then ``wait``."""
    def stop(self, worker: int) -> int | None:
        """Stops the worker; its exit code, or None when it was killed."""
    def alloc(
        self,
        nbytes: int,
        stream: int = 0,
        dtype: str = "uint8",
        shape: Sequence[int] | None = None,
        shared: bool = True,
    ) -> DeviceBuffer:
        """``nbytes`` of device memory from the shared pool (or the default pool)."""
    def write(self, ptr: int, data: bytes, stream: int | None = None) -> None:
        """Copies ``data`` to device address ``ptr`` (on ``stream`` if given) and waits."""
    def fill(self, ptr: int, nbytes: int, value: int, stream: int = 0) -> None:
        """Sets ``nbytes`` bytes at ``ptr`` to ``value``, queued on ``stream``."""
    def read(self, ptr: int, nbytes: int, stream: int | None = None) -> bytes:
        """Reads ``nbytes`` from device address ``ptr`` (on ``stream`` if given) and waits."""
    def synchronize(self, stream: int = 0) -> None:
        """Waits for ``stream`` on the host."""

@final
class View:
    """An input view or a result buffer of a job, valid until the job ends."""

    @property
    def ptr(self) -> int:
        """The device address of element 0 in this process."""
    @property
    def dtype(self) -> DType:
        """The dtype: a ``DType`` (a ``str`` enum, equal to its name)."""
    @property
    def shape(self) -> tuple[int, ...]:
        """The shape."""
    @property
    def strides(self) -> tuple[int, ...]:
        """The strides, in elements."""
    @property
    def nbytes(self) -> int:
        """Bytes from element 0 to the end of the last element."""
    @property
    def rung(self) -> str:
        """The rung it crossed on."""
    @property
    def read_only(self) -> bool:
        """Whether the parent lent the input read-only: it must not be written (``write_bytes``
        raises) and nothing written would reach the parent."""
    @property
    def stream(self) -> int:
        """The job's stream."""
    @property
    def valid(self) -> bool:
        """Whether its job is still open."""
    @property
    def is_result(self) -> bool:
        """A result buffer rather than an input."""
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """``__cuda_array_interface__`` version 3."""
    def read_bytes(self) -> bytes:
        """A copy of the view's bytes."""
    def write_bytes(self, data: bytes) -> None:
        """Writes ``data`` at the start of the view."""
    def __dlpack_device__(self) -> tuple[int, int]:
        """``(kDLCUDA, device)``."""
    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> object:
        """A DLPack capsule over the view (no copy)."""

@final
class Job:
    """One job: input views, result buffers, and the obligation to finish."""

    @property
    def id(self) -> int:
        """The job's id."""
    @property
    def stream(self) -> int:
        """The job's stream."""
    @property
    def inputs(self) -> list[View]:
        """The input views, in argument order."""
    @property
    def results(self) -> list[View]:
        """The result buffers requested so far."""
    @property
    def open(self) -> bool:
        """Whether the job is still open."""
    @property
    def live_exports(self) -> int:
        """How many DLPack tensors made from this job's views are still alive."""
    def lease(self) -> LeaseHold:
        """Makes the job a lease: it ends once its last tensor and the hold are gone."""
    def request_results(self, shapes: Sequence[tuple[str, Sequence[int]]]) -> list[View]:
        """Asks the parent for result memory: ``(dtype, shape)`` each."""
    def heartbeat(self) -> None:
        """Tells the parent the job is still being worked on: moves its handoff deadline."""
    def finish(self, streams: Sequence[int] | None = None) -> None:
        """Ends the job: DONE, imports freed, ACK."""
    def fail(self, message: str) -> None:
        """Reports the job as failed to the parent, then ends it."""
    def __enter__(self) -> Job:
        """Returns the job itself."""
    def __exit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        _tb: TracebackType | None = None,
    ) -> bool:
        """Finishes the job, or fails it when the block raised."""

@final
class NativeWorker:
    """A worker process's side of poolipc."""

    def __new__(cls, device: int | None = 0, any: bool = False) -> NativeWorker:
        """This process's worker side, from the environment its parent set."""
    @property
    def stream(self) -> int:
        """The jobs' stream."""
    @property
    def device(self) -> int:
        """The device ordinal this process works on."""
    @property
    def simulated(self) -> bool:
        """Whether the worker is on the simulated driver."""
    @staticmethod
    def connect(
        path: str | os.PathLike[str],
        device: int | None = 0,
        any: bool = False,
        token: str | None = None,
    ) -> NativeWorker:
        """Connects to a parent's listening socket (sending ``token`` first, if given)."""
    def next_job(self, concurrent: bool = False) -> Job | None:
        """Waits for the next job; None when the parent said goodbye."""
    def auto_take(self) -> None:
        """From now on the worker's thread takes jobs as they come."""
    def take(self, job: int | None = None, timeout: float | None = None) -> Job | None:
        """A job taken in the background (``auto_take``)."""
    def close(self) -> None:
        """Stops the worker thread."""

@final
class LeaseHold:
    """Keeps a leased job open while held (``Job.lease()``)."""

    @property
    def job(self) -> int | None:
        """The leased job's id (None once released)."""
    @property
    def open(self) -> bool:
        """Whether the leased job is still open."""
    def release(self) -> None:
        """Releases the hold; the job ends when its last tensor is freed."""

@final
class NativeListener:
    """A private listening socket of the process's parent (``Parent.listen``)."""

    @property
    def path(self) -> str:
        """The socket's path."""
    @property
    def refused(self) -> list[str]:
        """Peers refused before the handshake (another uid, no token), in words: the first 32."""
    @property
    def refused_count(self) -> int:
        """How many peers were refused before the handshake."""
    @property
    def closed(self) -> bool:
        """Whether the listener is closed."""
    def accept(self, timeout: float | None = None) -> int:
        """The next accepted worker's id."""
    def env(self) -> dict[str, str]:
        """What a worker process needs in its environment to connect."""
    def close(self) -> None:
        """Stops accepting and removes the socket."""
