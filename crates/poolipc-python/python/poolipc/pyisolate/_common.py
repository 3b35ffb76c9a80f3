"""What both sides of ``poolipc.pyisolate`` share: the wire names, the version check, torch
lookups, and the fallback to pyisolate's own serializer."""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any, Final

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
