"""poolipc for pyisolate (``pyisolate>=0.10,<0.11``): CUDA tensors between a pyisolate host and
its extension processes by pool pointer, under poolipc's ownership contract, while the host
keeps torch's ``backend:cudaMallocAsync`` (under which pyisolate's own CUDA path, torch's
legacy ``reduce_tensor``, does not work).

pyisolate has no hook for a tensor transport of its own: its ``SerializerRegistry`` is the one
place to plug in, and a serializer sees one object at a time, with no call around it and no
word when the other side drops what it received. So poolipc brings both:

- **A lease per tensor** (host to extension). The host's serializer lends each pool tensor as
  one poolipc job (``Parent.submit``) and puts ``{"__type__": "PoolipcTensor", "job": id,
  ...}`` into the RPC message; the extension's deserializer takes that job (the extension's
  worker holds several open at once) and gives the handler a torch tensor over the parent's
  memory (``torch.from_dlpack``, no copy). The job is a *lease*: it ends (DONE after the
  consumer's stream, imports freed, ACK) when the extension frees the last tensor made from
  it, whenever that is; the host keeps the tensor alive until then. Do not write a lent
  tensor in the host while its lease is out (``channel.leases_out()``): the extension sees
  the parent's memory. pyisolate's receive thread in the extension keeps the last message it
  received until the next one arrives, so a lease ends at the earliest then.
- **A return lease** (extension to host). A tensor the extension returns (or passes to a host
  API) lives in the extension's own allocator, which no parent can import. The host keeps one
  empty job open on the extension's worker; the extension's serializer asks it for result
  memory of the tensor's shape (from the parent's pool, ``torch.empty``, or the result arena
  when the parent was made with ``results="arena"``), copies into it on the GPU, finishes the
  job and sends ``{"__type__": "PoolipcResult", "job": id}``. The host's deserializer waits
  for that job and hands over the result, memory the host owns outright, ordered after the
  extension's copy on the legacy default stream (order work on other streams after it). The
  host then lends the next return lease. One GPU copy, no trip through host memory.

Everything else takes pyisolate's own path: CPU tensors, tensors when no channel serves the
message, tensors not from poolipc's pool (torch not under ``cudaMallocAsync``), a tensor on
another device, a tensor poolipc refuses. Each reason for a CUDA tensor is logged once, on the
``poolipc.pyisolate`` logger, at WARNING. Under ``cudaMallocAsync`` pyisolate's CUDA path
(torch's legacy ``reduce_tensor``) cannot share the tensor, so such a tensor goes as a CPU copy
(what pyisolate itself does with CUDA tensors when its CUDA IPC is off) and arrives as a CPU
tensor; under torch's native allocator it goes by pyisolate's CUDA IPC as before.

Recipe (host)::

    import poolipc, poolipc.pyisolate as pp, pyisolate
    poolipc.install_pool(0, handoff_timeout=600)  # before torch (ComfyUI: the pack's prestartup)
    parent = poolipc.Parent(0)
    channel = pp.HostChannel(parent)              # one per extension: a listener, a token
    pyisolate.register_adapter(pp.PoolipcAdapter())   # or, from your own adapter's
                                                      # register_serializers: pp.register(registry)
    config = pyisolate.ExtensionConfig(..., env={**channel.env()})
    ext = manager.load_extension(config)
    out = await ext.process(x)                    # x by pool pointer, out back through the return lease
    channel.close()                               # stops the extension's poolipc worker

In the extension nothing changes when the adapter is rehydrated there (pyisolate does it:
``PoolipcAdapter`` or your adapter calling ``register``): the extension's channel connects to
the host's listener (``POOLIPC_CONNECT`` from ``channel.env()``) when its serializers are
registered.

With several channels (several extensions) in one host, the host's serializer must know which
extension a message goes to, which pyisolate does not tell it: send inside ``with
channel.sending():`` (or call through ``channel.bind(ext)``). With exactly one channel it is
used for every message.

``handoff_timeout``: the parent kills a worker that holds a job longer than this without a
word, and a lease is a job. Give the process's parent a deadline at least as long as an
extension may keep a lent tensor (600 s above); the extension's channel finishes an unused
return lease every sixth of it, so an idle extension is not killed.

Without torch (tests on the simulated driver), ``poolipc.DeviceBuffer`` s are lent the same
way, the extension receives a ``LentView`` (DLPack, ``__cuda_array_interface__``,
``read_bytes``), and a ``LentView`` it returns goes back through the return lease.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.metadata
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from . import (
    DeviceBuffer,
    Job,
    LeaseHold,
    Parent,
    PoolipcError,
    TensorRef,
    View,
    Worker,
)

__all__ = [
    "HostChannel",
    "ChildChannel",
    "LentView",
    "PoolipcAdapter",
    "register",
    "child_channel",
    "LENT",
    "RETURNED",
    "CHANNEL_ENV",
    "REFRESH_ENV",
    "REQUIREMENT",
]

log = logging.getLogger("poolipc.pyisolate")

LENT: Final = "PoolipcTensor"
"""The ``__type__`` of a tensor lent host to extension."""
RETURNED: Final = "PoolipcResult"
"""The ``__type__`` of a tensor returned through a return lease, extension to host."""
CHANNEL_ENV: Final = "POOLIPC_PYISOLATE_CHANNEL"
"""The channel's token, in the extension's environment (``HostChannel.env()``)."""
REFRESH_ENV: Final = "POOLIPC_PYISOLATE_REFRESH_S"
"""A third of the parent's ``handoff_timeout`` (seconds): the extension renews the return
lease waiting for it every half of this."""
REQUIREMENT: Final = "pyisolate>=0.10,<0.11"
"""The pyisolate versions this module was written against (it reads their wire format)."""

_TENSOR_TYPES: Final = ("Tensor", "Parameter")
"""Class names pyisolate's serializer lookups use for torch tensors (by ``__name__``)."""

_said: set[str] = set()
_said_lock = threading.Lock()


def _once(key: str, msg: str, level: int = logging.WARNING) -> None:
    """Logs ``msg`` the first time ``key`` comes up in this process."""
    with _said_lock:
        if key in _said:
            return
        _said.add(key)
    log.log(level, msg)


def check_pyisolate() -> str:
    """pyisolate's version, if it is one this module speaks (``REQUIREMENT``); else
    ``ImportError`` saying which is installed."""
    try:
        version = importlib.metadata.version("pyisolate")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"poolipc.pyisolate needs {REQUIREMENT}: pyisolate is not installed") from None
    parts = version.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ImportError(f"poolipc.pyisolate needs {REQUIREMENT}: cannot read pyisolate's version {version!r}") from None
    if (major, minor) != (0, 10):
        raise ImportError(
            f"poolipc.pyisolate needs {REQUIREMENT} (it reads that version's wire format); "
            f"pyisolate {version} is installed"
        )
    return version


def _torch() -> Any:
    return sys.modules.get("torch")


def _is_torch_tensor(x: object) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _allocator_backend() -> str:
    torch = _torch()
    try:
        return str(torch.cuda.get_allocator_backend())
    except (AttributeError, RuntimeError):
        return "unknown"


def _fallback(t: Any, delegate: Callable[[Any], Any] | None, why: str, side: str) -> Any:
    """Sends ``t`` by pyisolate's own serializer, saying why once (for CUDA tensors). Under
    ``cudaMallocAsync`` pyisolate's CUDA path (torch's legacy ``reduce_tensor``) cannot share
    the tensor, so it goes as a CPU copy, as pyisolate itself sends CUDA tensors when its CUDA
    IPC is off (``rpc_serialization._prepare_for_rpc_impl``); the other side gets a CPU tensor."""
    if delegate is None:
        raise TypeError(
            f"poolipc.pyisolate: cannot send a {type(t).__name__} ({why or 'CPU tensor'}) and "
            "pyisolate registered no tensor serializer (is torch importable in this process?)"
        )
    if not getattr(t, "is_cuda", False):
        return delegate(t)
    if _allocator_backend() == "cudaMallocAsync":
        _once(
            f"{side}:{why.split(':')[0]}",
            f"poolipc.pyisolate: a CUDA tensor goes as a CPU copy by pyisolate's own path: {why} "
            "(pyisolate's CUDA IPC cannot share cudaMallocAsync memory)",
        )
        return delegate(t.cpu())
    _once(f"{side}:{why.split(':')[0]}", f"poolipc.pyisolate: a CUDA tensor takes pyisolate's own path: {why}")
    return delegate(t)


# --- host side ------------------------------------------------------------------------------

_HOST_CHANNELS: dict[str, HostChannel] = {}
_HOST_LOCK = threading.Lock()
_SENDING: contextvars.ContextVar[HostChannel | None] = contextvars.ContextVar(
    "poolipc_pyisolate_sending", default=None
)


class HostChannel:
    """One extension's poolipc channel, host side: a listener its process connects to, the
    leases lent to it, and its return lease.

    ``HostChannel(parent, directory=None, accept_timeout=60.0)``: ``parent`` is a
    ``poolipc.Parent`` (the process's one parent and its pool); ``directory`` where the
    listening socket goes (see ``Parent.listen``). Give ``env()`` to the extension (pyisolate:
    its ``ExtensionConfig["env"]``). The extension connects when pyisolate registers its
    serializers there; the host takes the connection at the first tensor it sends, or with
    ``connect()``.

    The channel's token (in ``env()``) is a capability: a process of the host's user that
    connects to the listener without it is dropped before the host sends anything, the pool
    FD included (``listener.refused_count``). A channel serves one worker: its listener
    closes once the extension connected, and a second connection finds nothing there.
    """

    def __init__(
        self, parent: Parent, *, directory: str | os.PathLike[str] | None = None, accept_timeout: float = 60.0
    ) -> None:
        self.parent = parent
        self.token = uuid.uuid4().hex
        # The token is the capability: the listener drops a connection that does not present
        # it before sending anything (the pool FD included), and takes one worker only.
        self.listener = parent.listen(directory, token=self.token, once=True)
        self.accept_timeout = accept_timeout
        self._worker: int | None = None
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._returned: dict[int, list[Any]] = {}
        self._lent: list[Any] = []
        self._ended: str | None = None
        self._closed = False
        self._returns: threading.Thread | None = None
        self.leases_lent = 0
        self.tensors_returned = 0
        with _HOST_LOCK:
            _HOST_CHANNELS[self.token] = self

    def env(self) -> dict[str, str]:
        """What the extension's process needs in its environment: the listener
        (``POOLIPC_CONNECT``, the simulated machine on ``POOLIPC_DRIVER=sim``), the device
        (``POOLIPC_DEVICE``, the parent's), this channel's token, and how often to renew an
        unused return lease (every sixth of the parent's ``handoff_timeout``)."""
        env = dict(self.listener.env())
        env.setdefault("POOLIPC_DEVICE", str(self.parent.device))
        env[CHANNEL_ENV] = self.token
        env[REFRESH_ENV] = repr(float(self.parent.options["handoff_timeout"]) / 3.0)
        return env

    @property
    def worker(self) -> int | None:
        """The extension's worker id, once connected."""
        return self._worker

    def connect(self, timeout: float | None = None) -> int:
        """The extension's worker id: waits for it to connect (at most ``timeout`` seconds,
        default ``accept_timeout``) and lends the first return lease. ``TimeoutError`` when
        it did not connect, ``PoolipcError`` when the channel is closed or the worker was
        refused."""
        with self._lock:
            if self._closed:
                raise PoolipcError(f"poolipc.pyisolate: channel {self.token} is closed")
            if self._worker is None:
                self._worker = self.listener.accept(self.accept_timeout if timeout is None else timeout)
                self._returns = threading.Thread(
                    target=self._serve_returns, name="poolipc-pyisolate-returns", daemon=True
                )
                self._returns.start()
            return self._worker

    def lend(self, tensor: Any) -> dict[str, Any]:
        """Lends ``tensor`` (a torch CUDA tensor of the pool, a ``DeviceBuffer`` or a
        ``TensorRef``) to the extension as a lease and returns the payload that goes into the
        RPC message. The tensor is kept alive until the extension dropped it. Raises what
        ``Parent.submit`` raises (``ValueError`` for a tensor that cannot be lent), and
        ``PoolipcError`` for a closed channel or a worker that is gone."""
        w = self.connect()
        if self._ended is not None:
            raise PoolipcError(f"poolipc.pyisolate: the extension's worker is gone: {self._ended}")
        if isinstance(tensor, DeviceBuffer):
            lent: Any = TensorRef(tensor.ptr, tensor.dtype, tensor.shape)
            keep: Any = tensor
        else:
            lent = keep = tensor
        handle = self.parent.submit(w, [lent])
        with self._lock:
            # Ended leases: their handles are waited on (a failure is logged), then dropped.
            still = []
            for h, k in self._lent:
                if h.done:
                    try:
                        h.wait(0)
                    except PoolipcError as e:
                        log.warning("poolipc.pyisolate: lease %d ended with an error: %s", h.id, e)
                else:
                    still.append((h, k))
            still.append((handle, keep))
            self._lent = still
            self.leases_lent += 1
        dtype = str(getattr(tensor, "dtype", "")).removeprefix("torch.")
        return {
            "__type__": LENT,
            "channel": self.token,
            "job": handle.id,
            "dtype": dtype,
            "shape": list(tensor.shape),
            "torch": _is_torch_tensor(tensor),
        }

    def leases_out(self) -> int:
        """Leases lent whose extension side has not ended yet."""
        with self._lock:
            return sum(1 for h, _ in self._lent if not h.done)

    def _serve_returns(self) -> None:
        """Keeps one return lease open on the extension's worker: an empty job whose results
        the extension asks for when it sends a tensor back."""
        w = self._worker
        assert w is not None
        while not self._closed:
            try:
                handle = self.parent.submit(w, [])
                results = handle.wait()
            except PoolipcError as e:
                with self._lock:
                    self._ended = str(e)
                    self._changed.notify_all()
                if not self._closed:
                    log.warning("poolipc.pyisolate: channel %s: the return lease failed: %s", self.token, e)
                return
            if results:
                with self._lock:
                    self._returned[handle.id] = results
                    self._changed.notify_all()

    def returned(self, job: int, index: int = 0, timeout: float | None = 120.0) -> Any:
        """The tensor the extension sent back through return lease ``job`` (a torch tensor,
        or without torch a ``DeviceBuffer``/``ArenaResult``). Waits for the lease to end.
        ``PoolipcError`` when the worker is gone, ``TimeoutError`` past ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while job not in self._returned:
                if self._ended is not None:
                    raise PoolipcError(
                        f"poolipc.pyisolate: return lease {job} did not end: the worker is gone ({self._ended})"
                    )
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"poolipc.pyisolate: return lease {job} did not end in time")
                self._changed.wait(0.1 if left is None else min(left, 0.1))
            results = self._returned.pop(job)
            self.tensors_returned += 1
        try:
            return results[index]
        except IndexError:
            raise PoolipcError(
                f"poolipc.pyisolate: return lease {job} has {len(results)} results, not {index + 1}"
            ) from None

    @contextlib.contextmanager
    def sending(self) -> Iterator[HostChannel]:
        """Within the block, tensors this thread (or task) sends go through this channel:
        needed when the host has several channels, as pyisolate's serializers are not told
        which extension a message goes to."""
        token = _SENDING.set(self)
        try:
            yield self
        finally:
            _SENDING.reset(token)

    def bind(self, extension: Any) -> Any:
        """A wrapper of the extension proxy whose methods send through this channel
        (``sending()`` around each call)."""
        return _Bound(extension, self)

    def close(self) -> None:
        """Stops the extension's poolipc worker (pyisolate's own connection is untouched):
        the parent says goodbye, the extension finishes the leases it holds and closes its
        side (at most the parent's ``stop_timeout`` later the parent stops waiting and takes
        back what is still lent). Then closes the listener and forgets the channel. Close a
        channel when the extension no longer holds tensors of it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            w = self._worker
        out = self.leases_out()
        if out:
            log.warning(
                "poolipc.pyisolate: closing channel %s while the extension holds %d leases: the "
                "parent waits for them at most its stop_timeout, then takes the memory back",
                self.token,
                out,
            )
        if w is not None:
            with contextlib.suppress(PoolipcError):
                self.parent.stop(w)
        self.listener.close()
        if self._returns is not None:
            self._returns.join(timeout=10)
        with _HOST_LOCK:
            _HOST_CHANNELS.pop(self.token, None)

    def __repr__(self) -> str:
        return f"HostChannel(token={self.token}, worker={self._worker}, path={self.listener.path})"


class _Bound:
    """An extension proxy whose coroutine methods run inside ``channel.sending()``."""

    def __init__(self, extension: Any, channel: HostChannel) -> None:
        self._extension = extension
        self._channel = channel

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._extension, name)
        if not callable(attr):
            return attr
        channel = self._channel

        async def call(*args: Any, **kwargs: Any) -> Any:
            with channel.sending():
                return await attr(*args, **kwargs)

        return call


def _sandbox_paths() -> list[str] | None:
    """See ``PoolipcAdapter.get_sandbox_system_paths``."""
    chosen = _SENDING.get()
    with _HOST_LOCK:
        if chosen is not None:
            waiting = [chosen]
        else:
            waiting = [c for c in _HOST_CHANNELS.values() if not c.listener.closed]
    waiting = [c for c in waiting if not c.listener.closed]
    if len(waiting) != 1:
        if waiting:
            _once(
                "sandbox-paths",
                f"poolipc.pyisolate: {len(waiting)} channels wait for their extensions and none "
                "was chosen: no sandbox is given a channel's directory (start each extension "
                "inside `with channel.sending():` or through channel.bind(extension))",
            )
        return None
    return [os.path.dirname(waiting[0].listener.path)]


def _channel_for_send() -> tuple[HostChannel | None, str]:
    """The channel a message being serialized goes through, or why there is none."""
    active = _SENDING.get()
    if active is not None:
        return active, ""
    with _HOST_LOCK:
        channels = list(_HOST_CHANNELS.values())
    if len(channels) == 1:
        return channels[0], ""
    if not channels:
        return None, "no poolipc channel exists in this host"
    return None, (
        f"{len(channels)} poolipc channels exist and none was chosen for this message "
        "(send inside `with channel.sending():` or through channel.bind(extension))"
    )


def _pool_tensor_why_not(t: Any, channel: HostChannel) -> str | None:
    """Why poolipc cannot lend CUDA tensor ``t`` by pool pointer, or None."""
    if t.device.index != channel.parent.device:
        return f"a tensor on cuda:{t.device.index}, not on the pool's device cuda:{channel.parent.device}"
    backend = _allocator_backend()
    if backend != "cudaMallocAsync":
        return (
            f"torch's CUDA allocator is {backend!r}, not cudaMallocAsync, so its tensors are not "
            "from poolipc's pool"
        )
    return None


def _host_serializer(delegate: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """The host's serializer for torch tensors: a pool tensor goes as a lease, everything
    else to ``delegate`` (pyisolate's own serializer, as registered before ours)."""

    def serialize(t: Any) -> Any:
        if not t.is_cuda:
            return _fallback(t, delegate, "", "host")
        channel, why = _channel_for_send()
        if channel is not None:
            why_not = _pool_tensor_why_not(t, channel)
            if why_not is None:
                try:
                    return channel.lend(t)
                except (ValueError, PoolipcError) as e:
                    why = f"poolipc refused it: {e}"
            else:
                why = why_not
        return _fallback(t, delegate, why, "host")

    serialize.__poolipc__ = True  # type: ignore[attr-defined]
    return serialize


def _host_lend_buffer(buf: DeviceBuffer) -> dict[str, Any]:
    """A ``DeviceBuffer`` (no torch) goes as a lease; there is no other path for it."""
    channel, why = _channel_for_send()
    if channel is None:
        raise TypeError(f"poolipc.pyisolate: cannot send a DeviceBuffer: {why}")
    return channel.lend(buf)


def _host_returned(payload: Mapping[str, Any]) -> Any:
    """The host's deserializer of a returned tensor."""
    with _HOST_LOCK:
        channel = _HOST_CHANNELS.get(str(payload.get("channel")))
    if channel is None:
        raise PoolipcError(f"poolipc.pyisolate: a returned tensor of an unknown channel {payload.get('channel')!r}")
    result = channel.returned(int(payload["job"]), int(payload.get("index", 0)))
    return result


# --- extension side -------------------------------------------------------------------------

_CHILD: ChildChannel | None = None
_CHILD_LOCK = threading.Lock()


class LentView:
    """What an extension without torch receives for a lent tensor: the input view of its
    lease (``__dlpack__``, ``__cuda_array_interface__``, ``read_bytes``, ``write_bytes``,
    ``shape``, ``dtype``), holding the lease open while it lives. ``release()`` (or dropping
    it and every DLPack tensor made from it) ends the lease."""

    __slots__ = ("view", "_hold", "job")

    def __init__(self, view: View, hold: LeaseHold, job: int) -> None:
        self.view = view
        self._hold = hold
        self.job = job

    @property
    def shape(self) -> tuple[int, ...]:
        return self.view.shape

    @property
    def dtype(self) -> str:
        return self.view.dtype

    @property
    def nbytes(self) -> int:
        return self.view.nbytes

    @property
    def rung(self) -> str:
        return self.view.rung

    def read_bytes(self) -> bytes:
        return self.view.read_bytes()

    def write_bytes(self, data: bytes) -> None:
        self.view.write_bytes(data)

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.view.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.view.__dlpack_device__()

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self.view.__cuda_array_interface__

    def release(self) -> None:
        """Ends the lease now if no DLPack tensor made from it is alive (else when the last
        one is freed). The view raises ``ExpiredViewError`` after that."""
        self._hold.release()

    def __repr__(self) -> str:
        return f"LentView(job={self.job}, view={self.view!r})"


class ChildChannel:
    """The extension's side of a channel: a worker connected to the host's listener, taking
    jobs in the background (leases and return leases), and the deserializer and serializer
    that use them. Made by ``child_channel()`` from the environment ``HostChannel.env()`` set.
    """

    def __init__(self, worker: Worker, token: str, refresh: float | None = None) -> None:
        self.worker = worker
        self.token = token
        self.refresh = refresh
        self._lock = threading.RLock()
        self._stash: dict[int, Job] = {}
        self._closed = False
        self.leases_taken = 0
        self.tensors_sent = 0
        worker.auto_take()
        self._refresher: threading.Thread | None = None
        if refresh is not None and refresh > 0:
            self._refresher = threading.Thread(target=self._refresh_loop, name="poolipc-pyisolate-refresh", daemon=True)
            self._refresher.start()

    def _take(self, job: int | None, timeout: float) -> Job | None:
        """A job from the worker's queue (by id, or the first), or None when none came in
        ``timeout``. ``PoolipcError`` once the host closed the channel (its parent said
        goodbye) or went away."""
        try:
            got = self.worker.take(job, timeout)
        except TimeoutError:
            return None
        if got is None:
            self._closed = True
            raise PoolipcError("poolipc.pyisolate: the host closed this extension's channel")
        return got

    def lease(self, job: int, timeout: float = 120.0) -> Job:
        """The lent job ``job``, taken when it arrives (the RPC message and the job travel on
        two sockets). ``TimeoutError`` when it does not come, ``PoolipcError`` when the host
        is gone."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                found = self._stash.pop(job, None)
            if found is not None:
                return found
            got = self._take(job, 0.05)
            if got is not None:
                return got
            if self._closed:
                raise PoolipcError("poolipc.pyisolate: the extension's channel is closed")
            if time.monotonic() > deadline:
                raise TimeoutError(f"poolipc.pyisolate: lease {job} did not arrive in {timeout} s")

    def receive(self, payload: Mapping[str, Any]) -> Any:
        """The tensor of a ``PoolipcTensor`` payload: a torch tensor over the parent's memory
        when torch is here (``torch.from_dlpack``), else a ``LentView``. Its lease ends when
        the tensor (and every view of it) is freed."""
        if payload.get("channel") != self.token:
            raise PoolipcError(
                f"poolipc.pyisolate: a lent tensor of channel {payload.get('channel')!r}, but this "
                f"extension is on channel {self.token!r}"
            )
        job = self.lease(int(payload["job"]))
        if len(job.inputs) != 1:
            job.fail(f"poolipc.pyisolate: a lease of {len(job.inputs)} tensors")
            raise PoolipcError(f"poolipc.pyisolate: lease {job.id} holds {len(job.inputs)} tensors, not 1")
        view = job.inputs[0]
        hold = job.lease()
        self.leases_taken += 1
        torch = _torch()
        if torch is None or not payload.get("torch", False):
            return LentView(view, hold, job.id)
        try:
            return torch.from_dlpack(view)
        finally:
            hold.release()

    def _return_job(self, timeout: float) -> Job:
        """The next return lease (an empty job), taken when it arrives; lent jobs that arrive
        first are kept for ``lease``. Called with ``_lock`` held."""
        deadline = time.monotonic() + timeout
        while True:
            got = self._take(None, min(0.05, max(0.0, deadline - time.monotonic())))
            if got is not None:
                if got.inputs:
                    self._stash[got.id] = got
                    continue
                return got
            if time.monotonic() > deadline:
                raise TimeoutError("poolipc.pyisolate: no return lease from the host in time")

    def send_with(self, dtype: str, shape: tuple[int, ...], fill: Callable[[View, Job], None]) -> dict[str, Any]:
        """Sends a tensor of ``dtype`` and ``shape`` to the host through the return lease:
        asks it for result memory, ``fill(result_view, job)`` writes it, the lease is
        finished. Returns the payload."""
        with self._lock:
            job = self._return_job(120.0)
            try:
                (out,) = job.request_results([(dtype, list(shape))])
                fill(out, job)
            except BaseException as e:
                with contextlib.suppress(PoolipcError):
                    job.fail(f"poolipc.pyisolate: sending a tensor back failed: {e}")
                raise
            job.finish()
            self.tensors_sent += 1
        return {"__type__": RETURNED, "channel": self.token, "job": job.id, "index": 0}

    def send_torch(self, t: Any) -> dict[str, Any]:
        """Sends torch CUDA tensor ``t`` back: one device-to-device copy into the result."""
        torch = _torch()

        def fill(out: View, job: Job) -> None:
            dst = torch.from_dlpack(out)  # the current stream waits on the job's stream
            dst.copy_(t)
            del dst

        return self.send_with(str(t.dtype).removeprefix("torch."), tuple(t.shape), fill)

    def send_view(self, v: LentView) -> dict[str, Any]:
        """Sends a ``LentView`` back (no torch): its bytes, copied through this process."""

        def fill(out: View, job: Job) -> None:
            out.write_bytes(v.read_bytes())

        return self.send_with(v.dtype, tuple(v.shape), fill)

    def _refresh_loop(self) -> None:
        """Every half ``refresh`` seconds, finishes the return lease waiting in the worker's
        queue (the host lends the next at once), so that the host's deadline
        (``handoff_timeout``) never sees an idle extension as hung. A return lease is taken
        out of the queue only to be used or renewed, so when the host says goodbye none is
        held here and the worker closes its side at once."""
        assert self.refresh is not None
        while not self._closed:
            time.sleep(self.refresh / 2)
            if not self._lock.acquire(timeout=0.1):
                continue
            try:
                job = self._return_job(0.0)
                job.finish()
            except TimeoutError:
                pass
            except PoolipcError as e:
                if not self._closed:
                    log.warning("poolipc.pyisolate: renewing the return lease failed: %s", e)
            finally:
                self._lock.release()

    def close(self) -> None:
        """Stops the worker (held leases are finished by it)."""
        self._closed = True
        self.worker.close()


def child_channel() -> ChildChannel | None:
    """This extension process's channel, connected at the first call (from the environment
    ``HostChannel.env()`` set); None when the host gave it no channel. ``ConnectError`` when
    the host's listener cannot be reached."""
    global _CHILD
    with _CHILD_LOCK:
        if _CHILD is not None:
            return _CHILD
        token = os.environ.get(CHANNEL_ENV)
        if not token:
            return None
        refresh_s = os.environ.get(REFRESH_ENV)
        refresh = float(refresh_s) if refresh_s else None
        worker = Worker.connect(token=token)
        _CHILD = ChildChannel(worker, token, refresh)
        log.info("poolipc.pyisolate: extension connected to its host's channel %s", token)
        return _CHILD


def _child_serializer(delegate: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """The extension's serializer for torch tensors: a CUDA tensor on the worker's device
    goes back through the return lease, everything else to ``delegate``."""

    def serialize(t: Any) -> Any:
        if not t.is_cuda:
            return _fallback(t, delegate, "", "child")
        channel = child_channel()
        if channel is None:
            why = "the host gave this extension no poolipc channel"
        elif t.device.index != channel.worker.device:
            why = f"a tensor on cuda:{t.device.index}, not on the worker's device cuda:{channel.worker.device}"
        else:
            try:
                return channel.send_torch(t)
            except (PoolipcError, TimeoutError, ValueError) as e:
                why = f"poolipc could not send it: {e}"
        return _fallback(t, delegate, why, "child")

    serialize.__poolipc__ = True  # type: ignore[attr-defined]
    return serialize


def _child_send_view(v: LentView) -> dict[str, Any]:
    channel = child_channel()
    if channel is None:
        raise TypeError("poolipc.pyisolate: cannot send a LentView: this extension has no channel")
    return channel.send_view(v)


def _child_receive(payload: Mapping[str, Any]) -> Any:
    channel = child_channel()
    if channel is None:
        raise PoolipcError(
            "poolipc.pyisolate: a lent tensor arrived, but this extension has no poolipc channel "
            f"({CHANNEL_ENV} is not set: give the extension HostChannel.env())"
        )
    return channel.receive(payload)


# --- registration ---------------------------------------------------------------------------


def _delegate_of(registry: Any, name: str) -> Callable[[Any], Any] | None:
    """The serializer registered under ``name`` before ours (pyisolate's), remembered across
    re-registrations (pyisolate registers its own again at every extension start, host.py)."""
    current: Callable[[Any], Any] | None = registry.get_serializer(name)
    if current is not None and getattr(current, "__poolipc__", False):
        remembered: Callable[[Any], Any] | None = getattr(current, "__poolipc_delegate__", None)
        return remembered
    return current


def _forget_cached_serializers() -> None:
    """pyisolate caches the serializer found for each Python type at first use
    (``rpc_serialization._SERIALIZER_BY_TYPE``, never cleared): drop torch's entries so that
    ours is found."""
    try:
        from pyisolate._internal import rpc_serialization  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        return
    cache = getattr(rpc_serialization, "_SERIALIZER_BY_TYPE", None)
    if isinstance(cache, dict):
        for t in list(cache):
            if getattr(t, "__name__", "") in _TENSOR_TYPES + ("DeviceBuffer", "LentView"):
                cache.pop(t, None)


def register(registry: Any = None, *, child: bool | None = None) -> None:
    """Registers poolipc's serializers into pyisolate's ``SerializerRegistry`` (the process's
    one, by default): call it from an ``IsolationAdapter.register_serializers(registry)``,
    which pyisolate calls in the host at every extension start and in each extension at its
    start, after its own tensor serializer (so ours, registered later, wins, and delegates to
    it). ``child``: which side this is (default: pyisolate's ``PYISOLATE_CHILD`` says).

    Host: torch tensors (``Tensor``, ``Parameter``) of the pool go as leases, others to
    pyisolate's serializer; ``DeviceBuffer`` s as leases; ``PoolipcResult`` payloads become
    the returned tensors. Extension: connects its channel (``child_channel()``), then
    ``PoolipcTensor`` payloads become tensors over the parent's memory, and CUDA tensors (and
    ``LentView`` s) sent back go through the return lease. Idempotent.

    Raises ``ImportError`` when pyisolate is missing or not 0.10.x; ``ConnectError`` (in an
    extension) when the host's listener cannot be reached.
    """
    check_pyisolate()
    if registry is None:
        from pyisolate._internal.serialization_registry import SerializerRegistry  # type: ignore[import-untyped, import-not-found, unused-ignore]

        registry = SerializerRegistry.get_instance()
    if child is None:
        child = os.environ.get("PYISOLATE_CHILD") == "1"
    make = _child_serializer if child else _host_serializer
    tensor_delegate = _delegate_of(registry, "Tensor")
    for name in _TENSOR_TYPES:
        delegate = tensor_delegate
        current = registry.get_serializer(name)
        if name != "Tensor" and current is not None and not getattr(current, "__poolipc__", False):
            # Someone registered a serializer of their own for this subclass: keep it.
            delegate = current
        ser = make(delegate)
        ser.__poolipc_delegate__ = delegate  # type: ignore[attr-defined]
        previous_deserializer = registry.get_deserializer(name)
        registry.register(name, ser, previous_deserializer)
    if child:
        child_channel()
        registry.register("LentView", _child_send_view)
        registry.register(LENT, _no_serializer(LENT), _child_receive)
    else:
        registry.register("DeviceBuffer", _host_lend_buffer)
        registry.register(RETURNED, _no_serializer(RETURNED), _host_returned)
    _forget_cached_serializers()


def _no_serializer(name: str) -> Callable[[Any], Any]:
    def refuse(obj: Any) -> Any:
        raise TypeError(f"poolipc.pyisolate: {name} is a wire payload, not something to send")

    return refuse


class PoolipcAdapter:
    """A complete pyisolate ``IsolationAdapter`` that only registers poolipc's serializers:
    for hosts that have no adapter of their own (``pyisolate.register_adapter(
    PoolipcAdapter())``). pyisolate allows one adapter per process: a host with its own (ComfyUI)
    calls ``poolipc.pyisolate.register(registry)`` from its ``register_serializers`` instead.
    pyisolate rehydrates it in each extension by its import path, so it must stay importable
    there (it is, wherever poolipc is installed)."""

    @property
    def identifier(self) -> str:
        return "poolipc"

    def get_path_config(self, module_path: str) -> dict[str, Any] | None:
        return None

    def setup_child_environment(self, snapshot: dict[str, Any]) -> None:
        return None

    def register_serializers(self, registry: Any) -> None:
        register(registry)

    def setup_web_directory(self, module: Any) -> None:
        return None

    def provide_rpc_services(self) -> list[type[Any]]:
        return []

    def handle_api_registration(self, api: Any, rpc: Any) -> None:
        return None

    def setup_child_event_hooks(self, extension: Any) -> None:
        return None

    def get_sandbox_system_paths(self) -> list[str] | None:
        """The directory of the one channel the extension being started is given, which its
        sandbox must reach, and no other channel's (not tried in a sandbox: the tests run
        with pyisolate's sandbox disabled). pyisolate does not say which extension it starts,
        so: the channel chosen in the calling context (``channel.sending()`` or
        ``channel.bind(ext)``: pyisolate starts an extension's process at its first call),
        else the only channel still waiting for its extension. None when that is not one
        channel (start each extension inside its channel's ``sending()``)."""
        return _sandbox_paths()

    def get_sandbox_gpu_patterns(self) -> list[str] | None:
        return None

