"""torch.multiprocessing under ``backend:cudaMallocAsync``: CUDA tensors put on ``mp.Queue``,
``mp.Pipe``, ``mp.Pool`` or passed as ``Process`` arguments cross over poolipc's shareable
pool, zero-copy, where torch's own IPC raises "cudaMallocAsync does not yet support
shareIpcHandle".

::

    import poolipc
    poolipc.install_pool()          # before torch
    import torch, torch.multiprocessing as mp
    poolipc.torch_sharing.enable()

How: the patch sits below torch's ``reduce_tensor``, at the storage level, so that the tuple
``reduce_tensor`` returns keeps torch's shape (Ray and vLLM rewrite its device field):

- ``UntypedStorage._share_cuda_`` (sender) returns torch's 8-tuple whose ``handle`` is
  poolipc's bytes (the owner's socket name, the pool generation, the export of the
  allocation's base) and whose ``ref_counter_handle`` names one share the sender keeps alive
  (storage and event) until the receiver releases it; an interprocess event recorded on the
  current stream orders the sender's writes before the receiver's reads. Where everything
  queued on that stream has already run, no event is made (``event_sync_required`` is
  False): there is nothing to order after, and the receiver waits for nothing.
- ``UntypedStorage._new_shared_cuda`` (receiver) recognises the bytes, imports the sender's
  pool once (its FD comes over the sender's abstract Unix socket, same uid only), imports the
  allocation once, waits for the event on the current stream and returns a storage over the
  imported memory; the storage's death frees the import and tells the sender.
- ``UntypedStorage._release_ipc_counter_cuda`` releases a share whose storage the receiver
  already holds (torch's cache of received storages).
- A ``ForkingPickler`` reducer wraps torch's so that unpickling a poolipc tensor enables the
  patch in the receiver first: a child started by any start method needs no code. Callers
  that rebuild ``reduce_tensor``'s tuple themselves (Ray, vLLM) call ``enable()`` in the
  receiver too.

Memory torch's own path can share (its native allocator) still goes torch's way; memory that
neither can share raises a ``RuntimeError`` saying why. A tensor whose allocation passes the
pool-pointer import limit (more than 128 chunks of 32 MiB: about 4 GiB) crosses as a copy:
the sender copies it on its current stream into a VMM allocation of its own, which the
receiver maps by FD (no import limit there); writes after the share are not seen across.

Without torch: a ``DeviceBuffer`` from the pool (``Parent.alloc``) pickles the same way, and
``Shareable(obj)`` wraps anything with ``data_ptr()``/``ptr`` and ``nbytes`` in the pool; each
arrives as a ``SharedMapping`` (``ptr``, ``nbytes``, ``read``/``write``,
``__cuda_array_interface__``), which pickles on to a third process.
"""

from __future__ import annotations

import atexit
import copyreg
import importlib
import os
import threading
from typing import Any

from . import _native
from ._native import DeviceBuffer, PoolipcError, SharedMapping

__all__ = ["enable", "enabled", "stats", "Shareable", "SharedMapping", "forget_kept"]

_HANDLE_MAGIC = b"POOLIPC-H1"
_REF_MAGIC = b"POOLIPC-R1"

# From the interpreter's exit on, the share server takes no GIL: a receiver hanging up then
# leaves what its shares kept to the exit.
atexit.register(_native._interpreter_exiting)

# A receiver queues a 4-byte memset on its current stream as each tensor arrives
# (``_native._kick``); ``POOLIPC_TORCH_EARLY_WORK=0`` turns it off.
_EARLY_WORK = os.environ.get("POOLIPC_TORCH_EARLY_WORK", "1") != "0"

_lock = threading.Lock()
_orig: dict[str, Any] = {}


def _torch() -> Any:
    return importlib.import_module("torch")


def _reductions() -> Any:
    importlib.import_module("torch.multiprocessing")
    return importlib.import_module("torch.multiprocessing.reductions")


def _is_handle(h: object) -> bool:
    return isinstance(h, bytes) and h.startswith(_HANDLE_MAGIC)


def _is_ref(h: object) -> bool:
    return isinstance(h, bytes) and h.startswith(_REF_MAGIC)


def _publish_child_env() -> None:
    """On the simulated driver, children must reach this process's simulated machine."""
    env = _native._child_env()
    if env is not None:
        os.environ[env[0]] = env[1]


def stats() -> dict[str, Any]:
    """This process's sharing figures: ``kept`` (shares kept alive for receivers),
    ``receivers`` (connected receiving processes), ``imports``, ``mappings``, ``pools``
    (what this process received and holds), ``address`` (its socket name)."""
    return dict(_native._stats())


def forget_kept() -> int:
    """Drops every share this process keeps alive for receivers (their blocks go back to the
    pool once nothing else holds them). Only for receivers that will never release and no
    longer touch the memory; returns how many."""
    return int(_native._forget_kept())


# ----- torch-free sharing ---------------------------------------------------------------


def _open_mapping(handle: bytes, offset: int, nbytes: int, ref: bytes, device: int) -> SharedMapping:
    return _native._open(handle, offset, nbytes, ref, device)


def _share_reduce(ptr: int, nbytes: int, device: int | None, keep: object) -> tuple[Any, ...]:
    _publish_child_env()
    r = _native._share(ptr, nbytes, device, keep)
    if isinstance(r, str):
        raise PoolipcError(f"poolipc: this memory cannot be shared: {r}")
    handle, offset, ref, _ = r
    if device is None:
        device = int(_native._pool_device())
    return (_open_mapping, (handle, offset, nbytes, ref, device))


class Shareable:
    """Pool memory to pickle to another process without torch. ``obj`` is a
    ``DeviceBuffer`` (``Parent.alloc``) or anything with ``data_ptr()`` or ``ptr`` and
    ``nbytes``; it is kept alive while a receiver holds the memory. Each pickling is one
    share; the receiver gets a ``SharedMapping``."""

    def __init__(self, obj: Any, nbytes: int | None = None, device: int | None = None) -> None:
        ptr = obj.data_ptr() if callable(getattr(obj, "data_ptr", None)) else obj.ptr
        self.ptr = int(ptr)
        self.nbytes = int(obj.nbytes if nbytes is None else nbytes)
        self.device = None if device is None else int(device)
        self._obj = obj
        # Children started from here on must reach a simulated machine (POOLIPC_DRIVER=sim).
        _publish_child_env()

    def __reduce__(self) -> tuple[Any, ...]:
        return _share_reduce(self.ptr, self.nbytes, self.device, self._obj)


def _reduce_mapping(m: SharedMapping) -> tuple[Any, ...]:
    # A received mapping sent on (A -> B -> C): the handle stays A's, this process keeps it.
    return _share_reduce(m.ptr, m.nbytes, m.device, m)


def _reduce_buffer(b: DeviceBuffer) -> tuple[Any, ...]:
    return _share_reduce(b.ptr, b.nbytes, None, b)


copyreg.pickle(SharedMapping, _reduce_mapping)
copyreg.pickle(DeviceBuffer, _reduce_buffer)


# ----- torch ----------------------------------------------------------------------------


def _share_cuda_(self: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    torch = _torch()

    nbytes = self.nbytes()
    if nbytes == 0 or self.data_ptr() == 0:
        return _orig["share"](self, *args, **kwargs)
    device = self.device.index
    if device is None:
        device = torch.cuda.current_device()
    # The current stream's raw handle (no Stream object: this runs for every tensor sent).
    raw = torch._C._cuda_getCurrentRawStream(device)
    _publish_child_env()
    # What the share keeps alive until the receiver releases it: the storage, and the event
    # once there is one.
    keep = [self, None]
    # An allocation above the import limit is copied on this stream first; the event,
    # recorded after, orders the receiver after the sender's writes and the copy.
    r = _native._share(self.data_ptr(), nbytes, device, keep, raw)
    if isinstance(r, str):
        try:
            return _orig["share"](self, *args, **kwargs)
        except RuntimeError as e:
            raise RuntimeError(
                f"poolipc: this CUDA tensor cannot be shared: {r}; torch's own IPC said: {e}. "
                "Call poolipc.install_pool() before importing torch (with "
                "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync), or clone the tensor after "
                "it, so that it lives in poolipc's pool"
            ) from e
    handle, offset, ref, idle = r
    if idle:
        # Everything queued on the stream has run (the writes, the copy): there is nothing to
        # order the receiver after, and no interprocess event to make, send and wait for.
        return (device, handle, nbytes, offset, ref, 0, b"", False)
    event = torch.cuda.Event(interprocess=True)
    event.record(torch.cuda.current_stream(device))
    keep[1] = event
    return (device, handle, nbytes, offset, ref, 0, event.ipc_handle(), True)


def _new_shared_cuda(
    cls: Any,
    device: Any,
    handle: Any,
    size: int,
    offset: int,
    ref_handle: Any,
    ref_offset: int,
    event_handle: Any,
    event_sync_required: bool,
    *rest: Any,
    **kwargs: Any,
) -> Any:
    if not _is_handle(handle):
        return _orig["new"](
            device, handle, size, offset, ref_handle, ref_offset, event_handle,
            event_sync_required, *rest, **kwargs,
        )
    torch = _torch()

    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if _EARLY_WORK:
        # This process's first GPU work for the tensor, before the rest of its rebuild:
        # without MPS the GPU's change from the sender's context then overlaps that host work.
        _native._kick(index, torch._C._cuda_getCurrentRawStream(index))
    mapping = _native._open(handle, int(offset), int(size), ref_handle if _is_ref(ref_handle) else None, index)
    if event_sync_required and event_handle:
        with torch.cuda.device(index):
            ev = torch.cuda.Event.from_ipc_handle(index, event_handle)
            ev.wait(torch.cuda.current_stream(index))
    t = torch.as_tensor(mapping, device=torch.device("cuda", index))
    return t.untyped_storage()


def _release_ipc_counter_cuda(cls: Any, ref_handle: Any, *args: Any, **kwargs: Any) -> Any:
    if _is_ref(ref_handle):
        _native._release(ref_handle)
        return None
    return _orig["release"](ref_handle, *args, **kwargs)


def _rebuild_cuda_tensor(*args: Any) -> Any:
    """What a poolipc CUDA tensor unpickles through: enables the patch here, then torch's
    ``rebuild_cuda_tensor``."""
    if not _orig:
        enable()
    return _reductions().rebuild_cuda_tensor(*args)


def _wrap_reducer(reducer: Any) -> Any:
    rebuild_cuda_tensor = _reductions().rebuild_cuda_tensor

    def reduce(obj: Any) -> Any:
        rv = reducer(obj)
        if isinstance(rv, tuple) and len(rv) == 2 and rv[0] is rebuild_cuda_tensor and _is_handle(rv[1][7]):
            return (_rebuild_cuda_tensor, rv[1])
        return rv

    reduce._poolipc_wraps = reducer  # type: ignore[attr-defined]
    return reduce


def _wrap_forking_pickler() -> None:
    from multiprocessing.reduction import ForkingPickler

    red = _reductions()

    extra: dict[Any, Any] = getattr(ForkingPickler, "_extra_reducers")  # noqa: B009
    for cls, reducer in list(extra.items()):
        if getattr(reducer, "_poolipc_wraps", None) is not None:
            continue
        if reducer is red.reduce_tensor:
            ForkingPickler.register(cls, _wrap_reducer(reducer))


def enabled() -> bool:
    """Whether ``enable()`` ran in this process."""
    return bool(_orig)


def enable() -> None:
    """Makes CUDA tensors in poolipc's pool cross torch.multiprocessing (and any caller of
    ``reduce_tensor``/``rebuild_cuda_tensor``) zero-copy. Idempotent; imports torch. Run it in
    the sending process; receivers that unpickle through ``multiprocessing`` enable it
    themselves, receivers that call ``rebuild_cuda_tensor`` directly must call it too."""
    with _lock:
        if _orig:
            _wrap_forking_pickler()
            return
        torch = _torch()
        _reductions()  # torch.multiprocessing registers torch's reducers first

        us = torch.UntypedStorage
        _orig["share"] = us._share_cuda_
        _orig["new"] = us._new_shared_cuda
        _orig["release"] = us._release_ipc_counter_cuda
        us._share_cuda_ = _share_cuda_
        us._new_shared_cuda = classmethod(_new_shared_cuda)
        us._release_ipc_counter_cuda = classmethod(_release_ipc_counter_cuda)
        _wrap_forking_pickler()
        _publish_child_env()
