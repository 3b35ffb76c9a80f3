"""Loading a pyisolate extension for the tests, offline: the extension's venv is made here
(`python -m venv --without-pip`, plus a .pth that adds this interpreter's site-packages, as
pyisolate itself does for share_torch), so pyisolate finds it and skips `uv venv --seed`, which
would fetch pip from the network. With no dependencies pyisolate runs no `uv` command, but it
insists on finding one on the PATH (environment.py, install_dependencies); uv is a dependency
of pyisolate's wheel and lies beside this interpreter.
"""

import os
import pathlib
import shutil
import site
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
WORKERS = HERE / "workers"
MODULE = WORKERS / "pyiso_module"

if str(WORKERS) not in sys.path:
    sys.path.insert(0, str(WORKERS))


def uv_dir(shim_dir=None):
    """The directory of the `uv` pyisolate will find, put on the PATH. With `shim_dir`, where
    there is no uv (the GPU machine, which has no package index), a `uv` that fails loudly if
    it is ever run is put there: pyisolate only looks for it when there is nothing to
    install, and a test whose extension made it run fails. None when there is no uv."""
    here = pathlib.Path(sys.executable).parent
    if (here / "uv").exists():
        os.environ["PATH"] = f"{here}{os.pathsep}{os.environ.get('PATH', '')}"
        return str(here)
    found = shutil.which("uv")
    if found:
        return os.path.dirname(found)
    if shim_dir is None:
        return None
    shim = pathlib.Path(shim_dir) / "uv"
    shim.write_text("#!/bin/sh\necho \"uv was run ($*), but this machine has none: the test expected "
                    "pyisolate to install nothing\" >&2\nexit 97\n")
    shim.chmod(0o755)
    os.environ["PATH"] = f"{shim_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    return str(shim_dir)


def make_venv(venv_root, name):
    """The extension's venv, where pyisolate will look for it, inheriting this interpreter's
    packages (poolipc, pyisolate, torch when here)."""
    from pyisolate._internal.environment import normalize_extension_name

    venv = pathlib.Path(venv_root).resolve() / normalize_extension_name(name)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    vi = sys.version_info
    child_site = venv / "lib" / f"python{vi.major}.{vi.minor}" / "site-packages"
    parents = [p for p in site.getsitepackages() if p.startswith(sys.prefix)] or site.getsitepackages()
    user = site.getusersitepackages()
    if isinstance(user, str) and os.path.isdir(user):
        parents.append(user)
    lines = "".join(f"import site; site.addsitedir(r'{p}')\n" for p in parents)
    extra = os.environ.get("PYTHONPATH")
    if extra:
        lines += "".join(f"import site; site.addsitedir(r'{p}')\n" for p in extra.split(os.pathsep) if p)
    (child_site / "_poolipc_test_parent.pth").write_text(lines)
    return venv


def load_extension(channel, venv_root, name="poolipc_test", share_torch=False):
    """A pyisolate ExtensionManager with the poolipc test extension loaded, its env carrying
    the channel's. Returns (manager, extension proxy)."""
    import pyisolate
    from pyisolate import ExtensionConfig, ExtensionManager, SandboxMode

    import pyiso_extension

    make_venv(venv_root, name)
    manager = ExtensionManager(pyiso_extension.PoolipcTestExtension, {"venv_root_path": str(venv_root)})
    config = ExtensionConfig(
        name=name,
        module_path=str(MODULE),
        isolated=True,
        dependencies=[],
        apis=[],
        share_torch=share_torch,
        share_cuda_ipc=False,
        sandbox_mode=SandboxMode.DISABLED,
        env=channel.env(),
    )
    ext = manager.load_extension(config)
    assert pyisolate.get_adapter() is not None
    return manager, ext
