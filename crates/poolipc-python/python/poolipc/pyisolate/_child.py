"""``poolipc.pyisolate``'s extension side: the ``ChildChannel`` (a worker connected to the
host's channel), the ``LentView`` an extension without torch receives, and the extension's
serializers (tensors go back through the return lease) and deserializer (lent tensors)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from .. import Job, LeaseHold, PoolipcError, View, Worker
from ._common import CHANNEL_ENV, REFRESH_ENV, RETURNED, _fallback, _torch, log

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
