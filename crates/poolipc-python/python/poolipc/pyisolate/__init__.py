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

import os
from collections.abc import Callable
from typing import Any

from ._child import ChildChannel, LentView, _child_receive, _child_send_view, _child_serializer, child_channel
from ._common import (
    CHANNEL_ENV,
    LENT,
    REFRESH_ENV,
    REQUIREMENT,
    RETURNED,
    _TENSOR_TYPES,
    check_pyisolate,
    log,
)
from ._host import HostChannel, _host_lend_buffer, _host_returned, _host_serializer, _sandbox_paths

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

