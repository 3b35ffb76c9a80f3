"""poolipc's ComfyUI pack: an example pair of nodes that sends an image through a worker
process and back without copying it (when the prestartup hook swapped the pool).

- ``prestartup_script.py``: opt-in (``POOLIPC_ENABLE=1``) pool swap before torch starts,
  following ComfyUI's ``--cuda-device``, ``--cpu`` and ``--disable-cuda-malloc``.
- ``worker_config.py``: which programs may run as workers (the server's file, never the
  workflow).
- ``worker_registry.py``: the running workers; stopped when replaced, freed, or at exit.
- ``nodes.py``: "poolipc: start worker" and "poolipc: invert in worker".

Workers are stopped when ComfyUI frees its models: this wraps
``comfy.model_management.unload_all_models``, which ``POST /free`` reaches (the "Unload
models" and "Free model and node cache" buttons) and which ComfyUI calls between prompts,
never during a node. ``soft_empty_cache`` is not hooked: ComfyUI calls it after every prompt
and while loading models, so stopping workers there would restart them on every run. A worker
stopped this way starts again the next time a node uses it. ``atexit`` stops the rest.
"""

import atexit
import functools
import logging

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, REGISTRY

WEB_DIRECTORY = "./js"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]

log = logging.getLogger("poolipc")


def _hook_model_freeing(registry):
    """Make ``comfy.model_management.unload_all_models`` stop the workers after it ran.
    ``main.py`` calls it through the module, so replacing the attribute reaches it."""
    try:
        import comfy.model_management as mm
    except ImportError as e:  # not inside ComfyUI
        log.debug(f"poolipc: no comfy.model_management ({e}); workers stop at exit only")
        return
    original = getattr(mm, "unload_all_models", None)
    if original is None or getattr(original, "_poolipc_stops_workers", False):
        return

    @functools.wraps(original)
    def unload_all_models(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            registry.stop_all("ComfyUI freed its models (unload_all_models)")

    unload_all_models._poolipc_stops_workers = True
    mm.unload_all_models = unload_all_models


_hook_model_freeing(REGISTRY)
atexit.register(REGISTRY.stop_all, "ComfyUI is exiting")
