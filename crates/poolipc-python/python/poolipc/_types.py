"""The shapes of the dicts the binding takes and returns, as ``TypedDict``\\ s (plain dicts at run time).

Re-exported by ``poolipc``, so that callers can annotate with them:
``stats: poolipc.MemoryStats = poolipc.memory_stats()``.
"""

from __future__ import annotations

import enum
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypedDict, cast

NativeResult = tuple[int, int, str, list[int], str, Any]
"""One result as ``NativeJobHandle.wait`` gives it: ``(ptr, nbytes, dtype, shape, rung,
owner)``; ``owner`` is what the allocator returned, a ``DeviceBuffer``, or an ``ArenaResult``."""

NativeAllocator = Callable[[str, list[int], int, int], tuple[int, object]]
"""The allocator ``NativeParent.submit`` calls: ``alloc(dtype, shape, nbytes, stream) -> (ptr,
owner)``; ``dtype`` is a ``DType`` (a ``str``)."""



class DType(str, enum.Enum):
    """An element type as torch spells it (``float32``, ``bfloat16``, ...): what a view, a
    result or an allocator call says of a tensor's elements. A ``str``: it equals its name
    (``DType.float32 == "float32"``), prints and ``json.dumps`` as it, and goes wherever a
    name went; ``DType("torch.float32")`` and ``DType(torch.float32)`` are accepted too."""

    bool = "bool"
    uint8 = "uint8"
    int8 = "int8"
    int16 = "int16"
    uint16 = "uint16"
    int32 = "int32"
    uint32 = "uint32"
    int64 = "int64"
    uint64 = "uint64"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"
    float64 = "float64"
    float8_e4m3fn = "float8_e4m3fn"
    float8_e5m2 = "float8_e5m2"
    complex64 = "complex64"
    complex128 = "complex128"

    @classmethod
    def _missing_(cls, value: object) -> DType | None:
        name = str(value).removeprefix("torch.")
        return cls.__members__.get(name)

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str(self), spec)

    def __repr__(self) -> str:
        return f"poolipc.DType.{self.value}"

class NativeInstallInfo(TypedDict):
    """What ``poolipc._native._install`` returns: whether this call installed the pool
    (``installed``; False when it already was), the driver in words, and the device."""

    installed: bool
    driver: str
    device: int


class InstallInfo(NativeInstallInfo):
    """What ``poolipc.install_pool`` returns: ``NativeInstallInfo`` and whether torch will
    allocate from the pool (``effective``), and if not, why (``reason``)."""

    effective: bool
    reason: str | None


class MemoryStats(TypedDict):
    """What ``poolipc.memory_stats`` returns: the shared pool's true figures in bytes (what
    torch's ``memory_allocated()``/``memory_reserved()`` report after ``install_pool``; torch's
    own read 0 after the swap), its device and the driver in words."""

    used_current: int
    used_high: int
    reserved_current: int
    reserved_high: int
    device: int
    driver: str


class ParentConfig(TypedDict, total=False):
    """The process parent's options, the keyword arguments of ``install_pool`` and ``Parent``
    (each may be left out; None is the same as leaving it out). They are set by whichever of
    ``install_pool`` and ``Parent`` comes first in the process; a later value that differs is
    a ``ValueError`` naming the clash (``Parent.options`` says what is in force).

    Deadlines, in seconds (more than 0; the defaults are 30, 5, 60, 5, 3): ``handoff_timeout``,
    how long a worker may go without progress on a job it holds before it is killed (the job
    raises ``JobFailedError``; only progress restarts it: a granted result request, a DONE
    that completes handoffs, the job's first error, a declared long job's heartbeat);
    ``stop_timeout``, how long ``Parent.stop`` waits for a worker
    to exit after saying goodbye before it kills it; ``handshake_timeout``, how long a new
    worker may take to start and shake hands; ``frame_timeout``, how long a message that
    began to arrive may take.

    Result memory: ``results``, ``"pool"`` (the default) or ``"arena"`` (see ``Parent``);
    ``arena_bytes``, the result arena's first chunk and growth step in bytes (256 MiB by
    default, or the cap if smaller); ``arena_max_bytes``, its cap (None: half the device).
    Arena sizes need ``results="arena"``, and the cap must hold the first chunk.

    ``isolated``: True to give workers no handle on the parent's memory (False by default):
    no pool FD, no VMM allocation by handle; their inputs cross by a copy into the arena
    (one device-to-device copy) and their results come from the arena, so a worker running
    untrusted code reaches the tensors lent to it, in their copies, and nothing else of the
    parent's. It is the default for each worker: ``Parent.spawn(..., isolated=True/False)``
    chooses one worker's trust.

    ``io_threads``: how many IO threads serve the workers, each its own share of them (1 to
    64; by default ``POOLIPC_IO_THREADS``, else one per 4 CPUs, 1 to 4).
    ``stats()["io_busy_ns"]`` growing near the wall time says they limit several workers at
    once, and more threads then lift that limit (each spins its own CPU while its workers'
    jobs run).

    ``gpu_turn``: without MPS, the length of a worker's turn on the GPU in seconds (0, the
    default unless ``POOLIPC_GPU_TURN_US`` says otherwise: no turns; 0.002 was measured). The GPU runs one process at a
    time and each change between two workers' contexts costs about 330 us on an H100, so
    jobs of several workers at once made 7200 jobs/s together against 46000 for one alone.
    While one worker holds the turn, a submit to another waits; the holder goes on for its
    turn's length. A wait of two turns past the holder's lets the submit go, and every
    submit after it until that worker's jobs ended; under MPS there are no turns. Off by
    default: a worker's host code is serialized with the others' too, and a slow job delays
    the others' submits by up to two turns.
    ``stats()["turn_waits"]`` and ``["turn_wait_ns"]`` count what they cost."""

    handoff_timeout: float | None
    stop_timeout: float | None
    handshake_timeout: float | None
    frame_timeout: float | None
    cancel_grace: float | None
    results: str | None
    arena_bytes: int | None
    arena_max_bytes: int | None
    isolated: bool | None
    io_threads: int | None
    gpu_turn: float | None


_CONFIG_HINTS: dict[str, object] = typing.get_type_hints(ParentConfig)
"""``ParentConfig``'s type for each key (``X | None``), what ``parent_config`` checks."""


def parent_config(options: Mapping[str, object], caller: str) -> ParentConfig:
    """``options`` as the native module takes them: every key of ``ParentConfig``, None where
    not given. ``TypeError`` for a keyword that is none of them, as Python says it, or for a
    value of the wrong type (as ``ParentConfig`` declares each: a deadline a number of
    seconds, a count or size a whole number, ``isolated`` True or False, ``results`` a
    string), and ``ValueError`` for a negative count or size; the message names the option
    and its value. The values' ranges are the native module's to check."""
    keys = ParentConfig.__optional_keys__
    for name in options:
        if name not in keys:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
    for name, value in options.items():
        if value is not None:
            _check_option(name, value, _CONFIG_HINTS[name])
    return cast(ParentConfig, {k: options.get(k) for k in sorted(keys)})


def _check_option(name: str, value: object, hint: object) -> None:
    """``value`` against ``ParentConfig``'s type for ``name`` (``X | None``)."""
    wanted = [t for t in typing.get_args(hint) if t is not type(None)]
    # bool is an int to Python, but True is no deadline, count or size.
    if bool in wanted:
        ok, kind = isinstance(value, bool), "True or False"
    elif float in wanted:
        ok, kind = isinstance(value, (int, float)) and not isinstance(value, bool), "a number of seconds"
    elif int in wanted:
        ok, kind = isinstance(value, int) and not isinstance(value, bool), "a whole number"
    else:
        ok, kind = isinstance(value, str), "a string"
    if not ok:
        raise TypeError(f"poolipc: {name}={value!r} is not {kind}")
    if kind == "a whole number" and cast(int, value) < 0:
        raise ValueError(f"poolipc: {name}={value!r} is negative: a count or a size is 0 or more")


class ParentOptions(TypedDict):
    """``Parent.options``: the process parent's device, its deadlines in seconds, whether it
    runs the canary battery, its result memory (``results``: ``pool`` or ``arena``; the
    arena's first chunk and cap in bytes, None without an arena or a cap), whether workers
    are ``isolated``, its ``io_threads``, its ``gpu_turn`` in seconds (0 for none),
    and who made it (``install_pool`` or ``Parent``)."""

    device: int
    handoff_timeout: float
    stop_timeout: float
    handshake_timeout: float
    frame_timeout: float
    cancel_grace: float
    canary: bool
    results: str
    arena_bytes: int | None
    arena_max_bytes: int | None
    isolated: bool
    io_threads: int
    gpu_turn: float
    made_by: str


class ParentStats(TypedDict):
    """``Parent.stats()``: the process parent's counters."""

    workers_connected: int
    workers_lost: int
    jobs_submitted: int
    jobs_completed: int
    jobs_failed: int
    pool_pointer_tensors: int
    host_staged_tensors: int
    arena_results: int
    arena_copied_inputs: int
    arena_slices_lent: int
    arena_results_carved: int
    vmm_handle_tensors: int
    vmm_handles_shared: int
    io_busy_ns: int
    """Nanoseconds the parent's IO thread(s) spent working (not waiting) since it started: its
    growth over the wall time near 1 (per IO thread) means the IO threads limit the jobs per
    second."""
    inputs_copied_back: int
    """Inputs that crossed by a copy (arena copy, host staging), lent writable, whose bytes
    were copied back into the caller's tensor after the job."""
    jobs_held_for_done: int
    """Jobs acknowledged before their DONE had completed on the GPU, held by the IO thread
    (querying DONE on the host) until it had."""
    ready_recorded_aside: int
    """Jobs whose READY went on the IO thread's own copy-engine stream because the caller's
    stream had nothing left to run (POOLIPC_READY_ASIDE=0 turns it off): without MPS that
    spares the GPU a context switch each way; never for an MPS client."""
    direct_lends: int
    """Jobs whose Lend the submitting thread wrote itself, finding its IO thread waiting
    (POOLIPC_DIRECT; on by default only where the IO thread does not spin); the others went
    through the IO thread."""
    direct_reads: int
    """Frames (a worker's DONE and ACK, mostly) that a thread waiting on a job read itself
    while its IO thread slept."""
    workers_busy: int
    """Workers with a job in flight now."""
    most_workers_busy: int
    """The most workers that had a job in flight at once. Without MPS workers that compute at
    once take turns on the GPU; the parent logs it once when two first are (see docs/guide.md: MPS)."""
    turn_waits: int
    """Submits that waited for their worker's turn on the GPU: without MPS a submit waits
    while another worker holds the turn (``gpu_turn``, off by default), so that the GPU
    does not change between the workers' contexts at every job."""
    turn_wait_ns: int
    """Nanoseconds those submits waited, all together."""
    turn_waits_ran_out: int
    """Turn waits that ran out (two turns past the holder's): the submit went anyway, and
    every submit after it went at once until the worker holding the turn had no job left."""
    done_events_open: int
    """The workers' DONE events the parent holds open now."""
    export_reuse: Literal["unchecked", "checking", "proven", "not_proven"]
    """Whether a new allocation at a recycled address of the same size is lent with its cached
    export (``"proven"`` by the canary battery's check on this driver) or exported again."""


class ArenaStats(TypedDict):
    """``Parent.arena_stats()``: whether the process parent has ``results="arena"``
    (``enabled``) and the arena exists yet (``created``); its bytes (``capacity``, ``used``,
    ``largest_free``), blocks out (``live_blocks``, counting those given back whose work is
    not done), ``pending_frees``, ``chunks``, the cap (``max_bytes``: half the device unless
    ``arena_max_bytes`` says otherwise), chunks given back to the device (``released_chunks``,
    ``released_bytes``: idle for 10 s, or by ``empty_cache``), and ``results_out``: arena
    results handed to Python whose block has not gone back."""

    enabled: bool
    created: bool
    capacity: int
    used: int
    largest_free: int
    live_blocks: int
    pending_frees: int
    chunks: int
    max_bytes: int | None
    released_chunks: int
    released_bytes: int
    results_out: int


class MpsStatus(TypedDict):
    """What ``poolipc.mps_status()`` returns: the MPS control program (path or None), where a
    client of this process would look for a daemon and whether that came from
    ``CUDA_MPS_PIPE_DIRECTORY``, whether a daemon is reachable there, and whether
    ``start_mps`` ran in this process."""

    control_binary: str | None
    pipe_directory: str
    pipe_directory_from_env: bool
    daemon_reachable: bool
    started_here: bool
