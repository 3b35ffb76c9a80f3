"""Which programs may run as workers: the ComfyUI owner's configuration, never the workflow.

A workflow names a worker; the command line comes from a JSON file on the server:

1. the file ``POOLIPC_WORKERS_FILE`` names, when that is set (it must exist), else
2. ``poolipc_workers.json`` at the top of ComfyUI's user directory (``ComfyUI/user/``; not a
   per-user folder such as ``user/default/``, which the ``/userdata`` API lets clients write),
   else
3. ``poolipc_workers.json`` in this pack's folder.

Format (see ``poolipc_workers.example.json``)::

    {"workers": {
        "example": ["{python}", "{pack}/example_worker.py"],
        "upscale": {"argv": ["/opt/esrgan/bin/python", "/srv/upscale.py"], "env": {"OMP_NUM_THREADS": "4"},
                    "env_allowlist": ["HF_HOME"], "isolated": true}
    }}

``{python}`` is ComfyUI's interpreter, ``{pack}`` this folder. The shipped example worker is
always available as ``example`` unless the file defines that name itself.

A worker does not inherit ComfyUI's environment (which may hold API keys): it gets ``env``,
the variables its ``env_allowlist`` names, and what every worker keeps (``PATH``, ``HOME``,
``TMPDIR``, ``LANG``, ``LD_LIBRARY_PATH``, ``PYTHONPATH``, ``POOLIPC_*``, ``CUDA_*``, ``LC_*``).
``"env_allowlist": "*"`` gives it the whole environment, as before.

``"isolated"`` chooses the worker's trust (docs/threat-model.md): ``true`` gives it no handle
on ComfyUI's memory (its tensors cross by a copy into an arena only it maps), ``false``
trusts it with the pool (no copy); left out, ``POOLIPC_ISOLATED`` decides for it.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

ENV_FILE = "POOLIPC_WORKERS_FILE"
INHERIT_ALL = "*"
FILE_NAME = "poolipc_workers.json"
DEFAULT_NAME = "example"
PACK_DIR = os.path.dirname(os.path.abspath(__file__))


class WorkerConfigError(RuntimeError):
    """The worker configuration is broken, or a workflow named a worker it does not have."""


@dataclass(frozen=True)
class WorkerSpec:
    """A configured worker: its name, command line, extra environment, the names of
    ComfyUI's variables it inherits (``None``: all of them), where it came from (a file
    path, or ``built-in``), and its trust (``isolated``: True, no handle on ComfyUI's memory;
    False, trusted with the pool; None, ``POOLIPC_ISOLATED`` decides)."""

    name: str
    argv: tuple
    env: dict = field(default_factory=dict)
    source: str = "built-in"
    env_allowlist: tuple | None = ()
    isolated: bool | None = None


def _builtin() -> dict:
    return {
        DEFAULT_NAME: WorkerSpec(
            DEFAULT_NAME, (sys.executable, os.path.join(PACK_DIR, "example_worker.py"))
        )
    }


def _user_directory():
    fp = sys.modules.get("folder_paths")
    if fp is None:
        try:
            import folder_paths as fp  # ComfyUI's; absent outside ComfyUI
        except ImportError:
            return None
    get = getattr(fp, "get_user_directory", None)
    if get is not None:
        try:
            return get()
        except Exception:  # noqa: BLE001 - an odd folder_paths: use the pack folder
            return None
    # ComfyUI before its --user-directory flag (mid-2024 and older) has no getter, only the
    # module's variable, ComfyUI/user.
    named = getattr(fp, "user_directory", None)
    return named if isinstance(named, str) and named else None


def config_path():
    """The configuration file in force, or None when there is none (only ``example``).
    Raises ``WorkerConfigError`` when ``POOLIPC_WORKERS_FILE`` names a missing file."""
    named = os.environ.get(ENV_FILE, "").strip()
    if named:
        if not os.path.isfile(named):
            raise WorkerConfigError(f"poolipc: {ENV_FILE}={named} does not exist (or is not a file)")
        return os.path.abspath(named)
    user = _user_directory()
    for folder in ([user] if user else []) + [PACK_DIR]:
        path = os.path.join(folder, FILE_NAME)
        if os.path.isfile(path):
            return path
    return None


def _expand(arg: str) -> str:
    return arg.replace("{python}", sys.executable).replace("{pack}", PACK_DIR)


def _parse_entry(path: str, name, entry) -> WorkerSpec:
    where = f"poolipc: {path}: worker {name!r}"
    if not isinstance(name, str) or not name.strip():
        raise WorkerConfigError(f"{where}: a worker name must be a non-empty string")
    env, allow, isolated = {}, [], None
    if isinstance(entry, dict):
        unknown = set(entry) - {"argv", "env", "env_allowlist", "isolated"}
        if unknown:
            raise WorkerConfigError(
                f"{where}: unknown keys {sorted(unknown)} (allowed: argv, env, env_allowlist, isolated)"
            )
        argv, env = entry.get("argv"), entry.get("env") or {}
        allow = entry.get("env_allowlist", [])
        isolated = entry.get("isolated")
        if isolated is not None and not isinstance(isolated, bool):
            raise WorkerConfigError(f"{where}: isolated must be true or false, not {isolated!r}")
    else:
        argv = entry
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
        raise WorkerConfigError(f"{where}: argv must be a non-empty list of non-empty strings")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise WorkerConfigError(f"{where}: env must map strings to strings")
    if allow == INHERIT_ALL:
        allow = None
    elif not isinstance(allow, list) or not all(isinstance(a, str) and a for a in allow):
        raise WorkerConfigError(
            f'{where}: env_allowlist must be a list of variable names, or "{INHERIT_ALL}" for all'
        )
    else:
        allow = tuple(allow)
    return WorkerSpec(name, tuple(_expand(a) for a in argv), dict(env), path, allow, isolated)


def load() -> dict:
    """Every configured worker by name (the built-in ``example`` included unless the file
    defines it). Raises ``WorkerConfigError`` naming the file and the fault."""
    specs = _builtin()
    path = config_path()
    if path is None:
        return specs
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise WorkerConfigError(f"poolipc: cannot read the worker configuration {path}: {e}") from e
    workers = doc.get("workers") if isinstance(doc, dict) else None
    if not isinstance(workers, dict):
        raise WorkerConfigError(f'poolipc: {path}: expected {{"workers": {{"<name>": [argv...]}}}}')
    for name, entry in workers.items():
        specs[name] = _parse_entry(path, name, entry)
    return specs


def names() -> list:
    """The names a workflow may choose (for the start node's combo); ``example`` alone when the
    configuration cannot be read (starting then reports why)."""
    try:
        specs = load()
    except WorkerConfigError:
        return [DEFAULT_NAME]
    return sorted(specs, key=lambda n: (n != DEFAULT_NAME, n))


def resolve(name) -> WorkerSpec:
    """The configured worker called ``name``; ``WorkerConfigError`` when the server has none."""
    specs = load()
    if isinstance(name, str) and name in specs:
        return specs[name]
    try:
        where = config_path() or f"no {FILE_NAME} (set {ENV_FILE} or create one)"
    except WorkerConfigError as e:
        where = str(e)
    raise WorkerConfigError(
        f"poolipc: refused: the workflow asks for worker {name!r}, which this server does not "
        f"configure (configured: {', '.join(sorted(specs))}; from {where}). Worker programs come "
        "from the server's configuration, never from the workflow."
    )
