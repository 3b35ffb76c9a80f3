"""poolipc: hand CUDA tensors between a parent process and its workers without copying them,
while the parent keeps PyTorch's stream-ordered allocator (``backend:cudaMallocAsync``).

- ``install_pool(device=0)``: before ``import torch``, make a shareable memory pool the device's
  current pool, so that torch allocates from it (ComfyUI: the pack's prestartup script).
- ``memory_stats()``: the pool's true figures (torch's ``memory_allocated()`` and
  ``memory_reserved()`` read 0 after the swap).
- ``Parent``: spawn workers, lend them torch tensors, get results back as torch tensors.
- ``Worker``: in a worker process, take jobs; views and result buffers go into torch, CuPy or
  JAX by DLPack or ``__cuda_array_interface__`` without a copy.

``POOLIPC_DRIVER=sim`` runs all of it on the simulated driver (no GPU, no torch needed).
"""

from __future__ import annotations

import logging
import os
import sys

from . import _native
from ._native import (
    DeviceBuffer,
    ExpiredViewError,
    Job,
    JobFailedError,
    PoolipcError,
    View,
    memory_stats,
)

__all__ = [
    "install_pool",
    "memory_stats",
    "Parent",
    "Worker",
    "Job",
    "View",
    "DeviceBuffer",
    "TensorRef",
    "PoolipcError",
    "JobFailedError",
    "ExpiredViewError",
    "ALLOC_CONF",
    "ASYNC_BACKEND",
]

log = logging.getLogger("poolipc")

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
ASYNC_BACKEND = "backend:cudaMallocAsync"
_DISABLE_FLAG = "--disable-cuda-malloc"


def _say(msg: str, level: int = logging.INFO) -> None:
    """One log line on the ``poolipc`` logger; on stderr too when nothing handles logging yet
    (a prestartup script runs before some ComfyUI versions configure logging)."""
    log.log(level, msg)
    if not logging.getLogger().hasHandlers() and not log.handlers:
        print(msg, file=sys.stderr, flush=True)


def _backend_choice(conf: str | None, argv: list[str]) -> tuple[str | None, str | None]:
    """What ``PYTORCH_CUDA_ALLOC_CONF`` should become, and why the swap cannot take effect.

    Returns ``(new_value or None to leave it, reason or None)``.
    """
    if _DISABLE_FLAG in argv:
        return None, f"ComfyUI was started with {_DISABLE_FLAG} (torch keeps its native allocator)"
    conf = (conf or "").strip()
    keys = [k.strip() for k in conf.split(",") if k.strip()]
    backends = [k.split(":", 1)[1].strip() for k in keys if k.split(":", 1)[0].strip() == "backend"]
    if not backends:
        return (",".join(keys + [ASYNC_BACKEND])), None
    if all(b == "cudaMallocAsync" for b in backends):
        return None, None
    return None, f"{ALLOC_CONF}={conf!r} chose another allocator backend"


def install_pool(device: int = 0) -> dict:
    """Swap the device's current memory pool for poolipc's shareable one. Call it before
    ``import torch`` (ComfyUI: from the pack's ``prestartup_script.py``).

    Refuses (``PoolipcError``) when torch is already imported: torch picks its allocator once.
    Puts ``backend:cudaMallocAsync`` into ``PYTORCH_CUDA_ALLOC_CONF`` unless the user chose
    otherwise (another backend, or ComfyUI's ``--disable-cuda-malloc``); then the swap has no
    effect on torch and handoffs cannot take the zero-copy rung, which is said in the log.
    Returns a dict: ``installed``, ``driver``, ``device``, ``effective`` (whether torch will
    allocate from the pool), ``reason`` (why not).
    """
    if "torch" in sys.modules:
        raise PoolipcError(
            "poolipc.install_pool: torch is already imported, so its allocator is chosen and "
            "the pool swap would not reach it; call install_pool() before `import torch` "
            "(in ComfyUI, from a prestartup_script.py)"
        )
    new_conf, reason = _backend_choice(os.environ.get(ALLOC_CONF), sys.argv)
    if new_conf is not None:
        os.environ[ALLOC_CONF] = new_conf
    info = dict(_native._install(device))
    info["effective"] = reason is None
    info["reason"] = reason
    if reason is None:
        _say(
            f"poolipc: installed a shareable CUDA memory pool as device {device}'s current pool "
            f"({info['driver']}, {ALLOC_CONF}={os.environ.get(ALLOC_CONF)}); "
            "torch.cuda.memory_allocated() and memory_reserved() will read 0 - the true figures "
            "are in poolipc.memory_stats() and `poolipc doctor`"
        )
    else:
        _say(
            f"poolipc: installed a shareable CUDA memory pool on device {device}, but the swap "
            f"has no effect: {reason}; torch's tensors will not come from the pool, so handoffs "
            "cannot go by pool pointer (they take the copy rung)",
            logging.WARNING,
        )
    return info


class TensorRef:
    """A tensor described by hand, for callers without torch: device address of element 0,
    dtype name (``float32``, ``bfloat16``, ...), shape, and strides in elements (None:
    contiguous)."""

    __slots__ = ("ptr", "dtype", "shape", "strides")

    def __init__(self, ptr: int, dtype: str, shape, strides=None):
        self.ptr = int(ptr)
        self.dtype = str(dtype)
        self.shape = tuple(int(d) for d in shape)
        self.strides = None if strides is None else tuple(int(s) for s in strides)

    def __repr__(self) -> str:
        return f"TensorRef(ptr={self.ptr:#x}, dtype={self.dtype}, shape={self.shape}, strides={self.strides})"


def _is_torch_tensor(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _describe(x):
    """``(ptr, dtype, shape, strides)`` of a torch tensor, a TensorRef, or a view-like object
    (``ptr``/``data_ptr()``, ``dtype``, ``shape``, ``strides``)."""
    if _is_torch_tensor(x):
        if not x.is_cuda:
            raise ValueError(f"poolipc: a {x.device} tensor cannot be lent; lend CUDA tensors")
        # data_ptr() already counts the storage offset; strides are in elements.
        return (x.data_ptr(), str(x.dtype).removeprefix("torch."), list(x.shape), list(x.stride()))
    if isinstance(x, TensorRef):
        return (x.ptr, x.dtype, list(x.shape), None if x.strides is None else list(x.strides))
    ptr = x.data_ptr() if callable(getattr(x, "data_ptr", None)) else getattr(x, "ptr", None)
    if ptr is None:
        raise TypeError(f"poolipc: cannot lend {type(x).__name__}: give a torch tensor or a TensorRef")
    strides = getattr(x, "strides", None)
    return (int(ptr), str(x.dtype), list(x.shape), None if strides is None else list(strides))


class Parent:
    """The parent side: spawns workers and lends them tensors.

    Every ``Parent`` of a process shares the one pool ``install_pool`` installed (or installs
    it, if nothing did: tensors torch allocated before cannot be lent then).
    """

    def __init__(self, device: int = 0):
        self.device = device
        self._native = _native.NativeParent(device)
        self.last_input_rungs: list[str] = []
        self.last_result_rungs: list[str] = []

    @property
    def driver(self) -> str:
        return self._native.driver

    @property
    def simulated(self) -> bool:
        return self._native.simulated

    def spawn(self, argv, env: dict | None = None) -> int:
        """Start ``argv`` as a worker (it inherits the socket; with ``POOLIPC_DRIVER=sim`` also
        the simulated machine) and shake hands; returns the worker id. The worker's
        ``POOLIPC_DEVICE`` is this process's device ordinal unless ``env`` sets it: set it to
        ``"parent"`` when the worker's ``CUDA_VISIBLE_DEVICES`` differs, and it finds the
        device by UUID."""
        return self._native.spawn([str(a) for a in argv], env)

    def spawn_python(self, script: str, *args, env: dict | None = None) -> int:
        """Start ``python script args...`` with this interpreter as a worker."""
        return self.spawn([sys.executable, script, *args], env)

    def pid(self, worker: int):
        return self._native.pid(worker)

    def canary_report(self, worker: int):
        return self._native.canary_report(worker)

    def run(self, worker: int, inputs, *, stream=None, alloc=None) -> list:
        """Lend ``inputs`` to ``worker``, serve its result requests, return its results.

        ``inputs``: torch CUDA tensors (pointer, dtype, shape and strides are taken from
        them; views with offsets and non-contiguous tensors go as they are, described by
        their strides; negative strides are refused) or ``TensorRef``\\ s.

        ``stream``: the stream READY is recorded on and which waits on the worker's DONE;
        default: torch's current stream when torch tensors are lent, else the legacy default
        stream (0).

        ``alloc(dtype, shape, nbytes) -> tensor``: makes each result; default: ``torch.empty``
        on this device when torch is imported and a torch tensor was lent, else a
        ``DeviceBuffer`` from the pool. Returned tensors are ordinary torch tensors from the
        pool; torch's stream has waited on DONE, so they may be used at once on it.
        """
        inputs = list(inputs)
        specs = [_describe(x) for x in inputs]
        torch_mode = any(_is_torch_tensor(x) for x in inputs) or (
            alloc is None and not inputs and "torch" in sys.modules
        )
        torch = sys.modules.get("torch")
        if stream is None:
            stream = torch.cuda.current_stream(self.device).cuda_stream if torch_mode else 0
        elif hasattr(stream, "cuda_stream"):
            stream = stream.cuda_stream
        native_alloc = None
        if alloc is None and torch_mode:
            dev = torch.device("cuda", self.device)

            def alloc(dtype, shape, nbytes):  # noqa: ARG001 - nbytes is for other allocators
                return torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=dev)

        if alloc is not None:
            user_alloc = alloc

            def native_alloc(dtype, shape, nbytes):
                t = user_alloc(dtype, tuple(shape), nbytes)
                ptr = t.data_ptr() if callable(getattr(t, "data_ptr", None)) else int(t.ptr)
                return (int(ptr), t)

        results, rungs = self._native.run(worker, specs, int(stream), native_alloc)
        self.last_input_rungs = list(rungs)
        self.last_result_rungs = [r[4] for r in results]
        return [r[5] for r in results]

    def stop(self, worker: int):
        """Tell the worker to stop and wait for it; returns its exit code."""
        return self._native.stop(worker)

    # Raw memory, for tools and tests without torch.
    def alloc(self, nbytes: int, *, dtype: str = "uint8", shape=None, stream: int = 0) -> DeviceBuffer:
        return self._native.alloc(nbytes, stream, dtype, None if shape is None else list(shape))

    def write(self, ptr: int, data: bytes) -> None:
        self._native.write(int(ptr), bytes(data))

    def read(self, ptr: int, nbytes: int) -> bytes:
        return bytes(self._native.read(int(ptr), int(nbytes)))

    def synchronize(self, stream: int = 0) -> None:
        self._native.synchronize(stream)


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
    """

    def __init__(self, device: int | str | None = None):
        """``device``: this process's ordinal of the parent's device; ``"parent"`` for whichever
        of its devices has the parent's UUID (ordinals differ when the two processes'
        ``CUDA_VISIBLE_DEVICES`` differ); ``"any:N"`` to work on ordinal N wherever the
        parent's pool is (by peer access where the devices reach each other, else every tensor
        by host staging). Unset: ``POOLIPC_DEVICE``, else 0. ``self.device`` is the ordinal it
        works on."""
        if device is None:
            device = os.environ.get("POOLIPC_DEVICE", "0")
        text = str(device)
        try:
            if text == "parent":
                self._native = _native.NativeWorker(None)
            elif text.startswith("any:"):
                self._native = _native.NativeWorker(int(text[4:]), any=True)
            else:
                self._native = _native.NativeWorker(int(text))
        except ValueError:
            raise ValueError(
                f"poolipc: device {device!r} is not an ordinal, 'parent' or 'any:N'"
            ) from None
        self.device = self._native.device

    @property
    def stream(self) -> int:
        """The jobs' stream (it waited on READY; DONE is recorded on it)."""
        return self._native.stream

    @property
    def simulated(self) -> bool:
        return self._native.simulated

    def next_job(self):
        """The next job, or None when the parent said goodbye."""
        return self._native.next_job()

    def __iter__(self):
        while True:
            job = self.next_job()
            if job is None:
                return
            yield job

    def close(self) -> None:
        self._native.close()
