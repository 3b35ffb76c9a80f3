"""The running workers of this ComfyUI process: at most one per start node.

- A start node that runs again stops the worker it replaces (changed input, ``/free``,
  ``--cache-none``: whatever made ComfyUI execute it again).
- ComfyUI freeing its models (``comfy.model_management.unload_all_models``, which ``/free``
  reaches) and process exit stop every worker (the hooks are set in ``__init__.py``).
- A worker that was stopped or died is started again, from the server's configuration, the
  next time a node uses it, and the log says so; a worker lost during a job fails that job
  with an error saying the next run starts a new one.
"""

from __future__ import annotations

import logging
import threading

from . import worker_config

log = logging.getLogger("poolipc")


class WorkerHandle:
    """What the start node gives the nodes downstream: which start node's worker, by name and
    device. The worker behind it may be replaced; the handle finds the current one."""

    def __init__(self, registry, key, name, device):
        self.registry, self.key, self.name, self.device = registry, key, name, device

    def __repr__(self):
        return f"poolipc worker {self.name!r} (start node {self.key}) on cuda:{self.device}"


class _Slot:
    def __init__(self, spec, device, parent, worker, pid):
        self.spec, self.device, self.parent, self.worker, self.pid = spec, device, parent, worker, pid


def _process_alive(pid) -> bool:
    """Linux: the process exists and is not a zombie (a dead child the parent has not reaped
    yet still answers ``kill(pid, 0)``)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError, ValueError):
        return False
    return state not in (b"Z", b"X")


class Registry:
    """Workers by start node; ``parent_for(device)`` gives the process's ``poolipc.Parent``."""

    def __init__(self, parent_for):
        self._parent_for = parent_for
        self._slots = {}
        self._lock = threading.RLock()

    # --- what the nodes call -------------------------------------------------------------

    def start(self, key, spec, device) -> WorkerHandle:
        """Start ``spec`` for start node ``key``, stopping the worker that node had."""
        with self._lock:
            old = self._slots.pop(key, None)
            if old is not None:
                self._stop(old, f"replaced: start node {key} ran again")
            self._slots[key] = self._spawn(spec, device)
        return WorkerHandle(self, key, spec.name, device)

    def acquire(self, handle):
        """``(parent, worker id, pid)`` of the handle's worker, alive: one that was stopped
        or died is started again (the log says which and why)."""
        with self._lock:
            slot = self._slots.get(handle.key)
            if slot is not None and slot.device == handle.device and self.alive(slot):
                return slot.parent, slot.worker, slot.pid
            if slot is None:
                why = "had been stopped (ComfyUI freed its models, or a later start replaced it)"
            else:
                why = f"(pid {slot.pid}) had died"
                self._slots.pop(handle.key, None)
                self._stop(slot, "it died", quiet=True)
            # From the server's configuration as it is now: a name it no longer has is refused.
            spec = worker_config.resolve(handle.name)
            slot = self._slots[handle.key] = self._spawn(spec, handle.device)
            log.warning(
                f"poolipc: worker {handle.name!r} {why}; started a new one (pid {slot.pid})"
            )
            return slot.parent, slot.worker, slot.pid

    def lost_during_job(self, handle, worker, error) -> None:
        """After a job failed: when the worker is gone, forget it and raise an error that says
        the next run starts a new one; a live worker (it reported an error) stays."""
        with self._lock:
            slot = self._slots.get(handle.key)
            if slot is None or slot.worker != worker or self.alive(slot):
                return
            self._slots.pop(handle.key, None)
            self._stop(slot, "lost during a job", quiet=True)
        raise RuntimeError(
            f"poolipc: worker {handle.name!r} (pid {slot.pid}) was lost during the job ({error}); "
            "the next run starts a new one"
        ) from error

    def stop_all(self, reason) -> int:
        """Stop every worker; never raises (it runs from ComfyUI's freeing and at exit)."""
        with self._lock:
            slots, self._slots = list(self._slots.values()), {}
        for slot in slots:
            self._stop(slot, reason)
        return len(slots)

    def running(self) -> dict:
        """Start node key -> (name, pid) of each worker the registry holds."""
        with self._lock:
            return {k: (s.spec.name, s.pid) for k, s in self._slots.items()}

    # --- the rest -----------------------------------------------------------------------

    @staticmethod
    def alive(slot) -> bool:
        try:
            pid = slot.parent.pid(slot.worker)
        except Exception:  # noqa: BLE001 - unknown to the parent: gone
            return False
        return pid is not None and _process_alive(pid)

    def _spawn(self, spec, device):
        parent = self._parent_for(device)
        env = dict(spec.env) if spec.env else None
        allow = None if spec.env_allowlist is None else list(spec.env_allowlist)
        worker = parent.spawn(list(spec.argv), env=env, env_allowlist=allow, isolated=spec.isolated)
        try:
            pid = parent.pid(worker)
        except Exception:  # noqa: BLE001 - for the log only
            pid = None
        log.info(f"poolipc: started worker {spec.name!r} (pid {pid}, from {spec.source}) on cuda:{device}")
        return _Slot(spec, device, parent, worker, pid)

    @staticmethod
    def _stop(slot, reason, quiet=False):
        try:
            slot.parent.stop(slot.worker)
        except Exception as e:  # noqa: BLE001 - already gone, or the parent is shutting down
            log.debug(f"poolipc: stopping worker {slot.spec.name!r} (pid {slot.pid}): {e}")
        if not quiet:
            log.info(f"poolipc: stopped worker {slot.spec.name!r} (pid {slot.pid}): {reason}")
