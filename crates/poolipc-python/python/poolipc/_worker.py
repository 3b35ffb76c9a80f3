"""The worker side: ``Worker`` takes the jobs its parent sends. Re-exported by ``poolipc``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Final

from . import _native
from ._native import Job
from ._pool import _ordinal

CONNECT_ENV: Final = _native.CONNECT_ENV
CONNECT_TOKEN_ENV: Final = _native.CONNECT_TOKEN_ENV

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
