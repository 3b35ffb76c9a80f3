"""``poolipc.pyisolate``'s host side: a ``HostChannel`` per extension, and the host's
serializers (pool tensors and ``DeviceBuffer`` s go as leases) and deserializer (returned
tensors)."""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .. import DeviceBuffer, Parent, PoolipcError, TensorRef
from ._common import CHANNEL_ENV, LENT, REFRESH_ENV, _allocator_backend, _fallback, _is_torch_tensor, _once, log

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
