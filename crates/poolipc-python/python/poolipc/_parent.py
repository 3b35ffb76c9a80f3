"""The parent side: ``Parent`` spawns workers and lends them tensors, ``JobHandle`` waits for
a submitted job, ``TensorRef`` describes a tensor by hand. Re-exported by ``poolipc``."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

from . import _native
from ._native import ArenaResult, DeviceBuffer, NativeListener
from ._pool import _ordinal
from ._types import ArenaStats, ParentConfig, ParentOptions, ParentStats, parent_config

if TYPE_CHECKING:
    from typing_extensions import Unpack

_RESULTS: Final = ("pool", "arena")

Allocator = Callable[[str, tuple[int, ...], int], Any]
"""What ``Parent.run``/``submit`` take as ``alloc``: ``alloc(dtype, shape, nbytes)`` (``dtype`` a
``DType``, which is a ``str``) returns the result's owner, an object with ``data_ptr()`` (a torch tensor) or ``ptr`` (a ``DeviceBuffer``)."""


class _HasCudaStream(Protocol):
    """A torch stream, as far as poolipc reads it."""

    @property
    def cuda_stream(self) -> int: ...


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


def _read_only_flags(read_only: bool | Iterable[bool], n: int) -> list[bool] | None:
    """One read-only flag per input: ``read_only`` for all of them, or one each; None for
    all writable (the native default, no list to build)."""
    if read_only is False:
        return None
    if isinstance(read_only, bool):
        return [read_only] * n
    flags = [bool(f) for f in read_only]
    if len(flags) != n:
        raise ValueError(f"poolipc: read_only has {len(flags)} flags for {n} inputs")
    return flags


def _owners(results: list[Any], torch_results: bool) -> list[Any]:
    """What a job's results are to its caller: what the allocator made, or (arena results
    of a torch job) torch tensors over the ``ArenaResult``\\ s."""
    owners = [r[5] for r in results]
    if torch_results:
        torch: Any = sys.modules["torch"]
        owners = [torch.from_dlpack(o) if isinstance(o, ArenaResult) else o for o in owners]
    return owners


def wait_any(handles: Sequence[JobHandle], timeout: float | None = None) -> int:
    """Waits, the GIL released, until one of ``handles`` has ended and returns its index (the
    lowest of those ended when it looks); its ``wait()`` then returns at once. For one thread
    driving several workers: submit to each, take whichever job ends first, submit to that
    worker again (under MPS one thread driving four workers ran more jobs/s than a thread for
    each, which hand the GIL to each other at every job).

    Raises ``TimeoutError`` if none had ended after ``timeout`` seconds, ``ValueError`` for no
    handles or a timeout that is not 0 or more, ``TypeError`` for anything that is not a
    ``JobHandle``. Ctrl-C interrupts the wait, not the jobs.
    """
    natives = []
    for i, h in enumerate(handles):
        if not isinstance(h, JobHandle):
            raise TypeError(
                f"poolipc: wait_any() takes JobHandles (from Parent.submit); handles[{i}] has type "
                f"{type(h).__name__}"
            )
        natives.append(h._native)
    return _native.wait_any(natives, timeout)


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
            self._results = _owners(results, self._torch)
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
    ``handoff_timeout``, ``stop_timeout``, ``handshake_timeout``, ``frame_timeout`` and ``cancel_grace``, in
    seconds (``None``: the process parent's; the defaults are 30, 5, 60, 5, 3), and the result
    memory below. They are set by whichever of ``install_pool`` and ``Parent`` comes first in
    the process; a later value that differs is a ``ValueError`` naming the clash (``options``
    says what is in force).

    Result memory, also set by the first creation in the process (a later different value is
    a ``ValueError``): ``results="pool"`` (the default: each result is
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
        *,
        isolated: bool | None = None,
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

        ``isolated`` chooses this worker's trust: True gives it no handle on the parent's
        memory (its tensors cross by arena copy, its results come from its own arena), False
        trusts it with the pool (pool pointers, no copy); None, the default, takes the
        parent's ``isolated`` option. A trusted and an isolated worker may serve one parent.

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
        if isolated is not None and not isinstance(isolated, bool):
            raise TypeError(
                f"poolipc: isolated must be True, False or None, not {isolated!r}"
            )
        return self._native.spawn([os.fspath(a) for a in argv], env, allow, isolated)

    def spawn_python(
        self,
        script: str | os.PathLike[str],
        *args: str,
        env: Mapping[str, str] | None = None,
        env_allowlist: Iterable[str] | None = None,
        isolated: bool | None = None,
    ) -> int:
        """Start ``python script args...`` with this interpreter as a worker (see ``spawn``)."""
        return self.spawn([sys.executable, script, *args], env, env_allowlist, isolated=isolated)

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
        by pool pointer and by host staging, results in the arena and inputs copied into it
        (and back), arena slices lent and results carved out of them, jobs held for their
        DONE and DONE events open, the IO threads' busy time, and whether export reuse was
        proven (``ParentStats`` says each). Never waits for a job."""
        return self._native.stats()

    def lower_import_limit(self, max_chunks: int) -> None:
        """Lowers the pool-pointer import limit from here on: an allocation touching more
        than ``max_chunks`` of the driver's 32 MiB chunks (128 by default) no longer goes by
        pointer: a job's tensor takes host staging or the arena copy, a tensor shared through
        ``torch_sharing`` crosses as a copy. For a driver whose crash boundary ``poolipc doctor
        --probe-limit`` found lower. ``ValueError`` above the limit in force."""
        self._native.lower_import_limit(max_chunks)

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
        native, inputs, torch_results = self._submit(worker, inputs, stream, alloc, results, read_only)
        return JobHandle(native, inputs, torch_results=torch_results)

    def _submit(
        self,
        worker: int,
        inputs: Iterable[Any],
        stream: int | _HasCudaStream | None,
        alloc: Allocator | None,
        results: str | None,
        read_only: bool | Iterable[bool],
        wait_first: bool = False,
    ) -> tuple[_native.NativeJobHandle, list[Any], bool]:
        """``submit``'s work: the native handle, the inputs (kept alive until the job ended)
        and whether its results are torch tensors over arena results. ``wait_first``: the
        native submit waits for the job once in the same release of the GIL (``run``)."""
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
        flags = _read_only_flags(read_only, len(inputs))
        torch: Any = sys.modules.get("torch")
        torch_mode = torch is not None and (
            any(isinstance(x, torch.Tensor) for x in inputs) or (alloc is None and not inputs)
        )
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
                # Runs on the parent's allocator thread (it took the GIL): torch's current stream
                # there is the default one, so the job's stream is made current for torch.
                if torch_stream is not None:
                    with torch.cuda.stream(torch_stream):
                        t = user_alloc(dtype, tuple(shape), nbytes)
                else:
                    t = user_alloc(dtype, tuple(shape), nbytes)
                ptr = t.data_ptr() if callable(getattr(t, "data_ptr", None)) else int(t.ptr)
                return (int(ptr), t)

        native_handle = self._native.submit(worker, inputs, raw_stream, native_alloc, inputs, flags, wait_first)
        return native_handle, inputs, to_arena and torch_mode

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
        ``DeviceBuffer`` from the pool. It is called on a thread of the parent's made for it
        (holding the GIL; a wait for the GIL holds up only this job, never other workers'
        jobs), with ``stream`` as torch's current stream; it must not wait on this parent (no
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
        # submit(...).wait() without the JobHandle between them (a round trip's microseconds).
        native, inputs, torch_results = self._submit(worker, inputs, stream, alloc, results, read_only, True)
        out, rungs = native.wait(None)
        self.last_input_rungs = list(rungs)
        self.last_result_rungs = [r[4] for r in out]
        return _owners(out, torch_results)

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
