"""poolipc's ComfyUI prestartup hook: swap torch's CUDA memory pool for a shareable one, so
that tensors can be handed to isolated worker processes without a copy.

Opt in with ``POOLIPC_ENABLE=1`` in ComfyUI's environment; without it this file does nothing.
ComfyUI runs it before it imports torch (``execute_prestartup_script()`` in ``main.py``). It
works whether ComfyUI's ``cuda_malloc`` ran before (current ``main.py``) or runs after (older
``main.py``) the prestartup scripts, and it never breaks startup: any failure is logged with
its reason and ComfyUI starts as before.

The device comes from ComfyUI's own flags, read here before anything initialises CUDA:

- ``--cuda-device N``: ``CUDA_VISIBLE_DEVICES=N`` is set now, as ComfyUI's ``main.py`` will set
  it (older ``main.py`` sets it only after the prestartup scripts ran), and the pool goes on
  device 0, which is then ComfyUI's device. ``--default-device N`` likewise (ComfyUI's order).
- ``--cpu``: nothing is installed (there is no CUDA device to share); the nodes refuse.
- ``--disable-cuda-malloc``: nothing is installed (torch keeps its native allocator, so a pool
  swap would have no effect); tensors take host staging.
- none of those: device ``POOLIPC_DEVICE`` (default 0). ComfyUI itself then uses device 0, so
  set it only when something else moves ComfyUI to another device; the nodes refuse when the
  pool's device and ComfyUI's device disagree.

What happened is recorded in ``sys.modules["_poolipc_comfyui_startup"]`` for the nodes.
"""


def _poolipc_prestartup():
    import argparse
    import ast
    import logging
    import os
    import sys
    import types

    log = logging.getLogger("poolipc")

    def say(msg, level=logging.WARNING):
        # Before ComfyUI configures logging (the mid-2024 main.py runs prestartup scripts
        # first), a log call drops INFO and logging's last-resort handler prints WARNING:
        # print it ourselves instead, once.
        if logging.getLogger().hasHandlers() or log.handlers:
            log.log(level, msg)
        else:
            print(msg, file=sys.stderr, flush=True)

    # What the nodes read: mode is one of "off", "installed", "host-staging", "cpu", "failed".
    state = types.ModuleType("_poolipc_comfyui_startup")
    state.mode, state.device, state.reason, state.mps = "off", None, None, None
    sys.modules["_poolipc_comfyui_startup"] = state

    def record(mode, device=None, reason=None):
        state.mode, state.device, state.reason = mode, device, reason

    if os.environ.get("POOLIPC_ENABLE", "").strip().lower() not in ("1", "true", "yes", "on"):
        return

    here = os.path.dirname(os.path.abspath(__file__))

    def comfy_flags():
        """ComfyUI's parsed arguments when ``main.py`` already parsed them (it does, before
        the prestartup scripts), else ``sys.argv`` parsed the way ComfyUI parses it."""
        cli = sys.modules.get("comfy.cli_args")
        args = getattr(cli, "args", None)
        if args is not None:
            return args
        p = argparse.ArgumentParser(add_help=False)
        p.add_argument("--cuda-device", type=int, default=None)
        p.add_argument("--default-device", type=int, default=None)
        p.add_argument("--cpu", action="store_true")
        p.add_argument("--directml", type=int, nargs="?", const=-1, default=None)
        p.add_argument("--disable-cuda-malloc", action="store_true")
        p.add_argument("--cuda-malloc", action="store_true")
        try:
            return p.parse_known_args(sys.argv[1:])[0]
        except SystemExit:  # ComfyUI's own parser reports a bad flag; use none here
            return argparse.Namespace()

    def prestartups_run_before_ours():
        """The packs whose ``prestartup_script.py`` ComfyUI ran before this one: it walks each
        ``custom_nodes`` folder in ``os.listdir`` order (not sorted), so the same walk in the
        same process gives the same order. Each entry: (folder, imports torch directly?)."""
        fp = sys.modules.get("folder_paths")
        try:
            roots = list(fp.get_folder_paths("custom_nodes")) if fp is not None else []
        except Exception:  # noqa: BLE001 - an odd folder_paths: fall back to our parent
            roots = []
        mine = os.path.dirname(here)
        if not any(os.path.realpath(r) == os.path.realpath(mine) for r in roots):
            roots.append(mine)
        before = []
        for root in roots:
            try:
                entries = os.listdir(root)
            except OSError:
                continue
            for entry in entries:
                path = os.path.join(root, entry)
                if os.path.realpath(path) == os.path.realpath(here):
                    return before
                script = os.path.join(path, "prestartup_script.py")
                if os.path.isfile(path) or path.endswith(".disabled") or not os.path.exists(script):
                    continue
                before.append((path, imports_torch(script)))
        return before

    def imports_torch(script):
        try:
            with open(script, "rb") as f:
                tree = ast.parse(f.read(), script)
        except (OSError, SyntaxError, ValueError):
            return False
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            if any(n == "torch" or n.startswith("torch.") for n in names):
                return True
        return False

    def torch_came_first():
        ran = prestartups_run_before_ours()
        culprits = [p for p, t in ran if t]
        if culprits:
            who = "imported by " + ", ".join(f"{p}/prestartup_script.py" for p in culprits)
        elif ran:
            who = (
                "no earlier prestartup script imports torch directly; these ran before poolipc's, "
                "one may import it through another module: " + ", ".join(p for p, _ in ran)
            )
        else:
            who = "not by another pack's prestartup script (something ComfyUI loaded earlier did)"
        return (
            f"torch is already imported ({who}), so torch's allocator is chosen and the pool swap "
            "would not reach it. ComfyUI runs prestartup scripts in the order the file system "
            "lists custom_nodes (os.listdir, not alphabetical): make that pack import torch later "
            "(in its __init__.py, not its prestartup_script.py), or disable it (rename its folder "
            "to end in .disabled)"
        )

    try:
        flags = comfy_flags()
        if getattr(flags, "cpu", False) or getattr(flags, "directml", None) is not None:
            flag = "--cpu" if getattr(flags, "cpu", False) else "--directml"
            record("cpu", reason=f"ComfyUI was started with {flag}")
            say(
                f"poolipc: not enabled: ComfyUI was started with {flag}, so there is no CUDA device "
                "to share; nothing installed, and the poolipc nodes will refuse. ComfyUI starts as before."
            )
            return
        device, chosen_by = None, None
        cuda_device = getattr(flags, "cuda_device", None)
        default_device = getattr(flags, "default_device", None)
        if default_device is not None:  # main.py: the default device first, the rest after
            order = [d for d in range(32) if d != default_device]
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, [default_device] + order))
            device, chosen_by = 0, f"--default-device {default_device}"
        if cuda_device is not None:  # main.py applies it after --default-device: it wins
            os.environ["CUDA_VISIBLE_DEVICES"] = str(cuda_device)
            device, chosen_by = 0, f"--cuda-device {cuda_device}"
        if chosen_by is not None:
            ignored = os.environ.get("POOLIPC_DEVICE")
            say(
                f"poolipc: ComfyUI's {chosen_by}: CUDA_VISIBLE_DEVICES="
                f"{os.environ['CUDA_VISIBLE_DEVICES']} set before CUDA starts (as ComfyUI sets it), "
                "the pool goes on device 0"
                + (f"; POOLIPC_DEVICE={ignored} is ignored" if ignored else ""),
                logging.INFO,
            )
        else:
            device = int(os.environ.get("POOLIPC_DEVICE", "0"))
        if getattr(flags, "disable_cuda_malloc", False):
            record("host-staging", device=device, reason="ComfyUI was started with --disable-cuda-malloc")
            say(
                "poolipc: ComfyUI was started with --disable-cuda-malloc: torch keeps its native "
                "allocator, so the swap has no effect and poolipc installed nothing; tensors will "
                "cross to workers by host staging (a copy), not by pool pointer."
            )
            return
        if "torch" in sys.modules:
            reason = torch_came_first()
            record("failed", device=device, reason=reason)
            say(f"poolipc: not enabled: {reason}. ComfyUI starts as before.")
            return
        try:
            import poolipc
        except ImportError as e:
            record("failed", device=device, reason=f"the poolipc wheel is not importable ({e})")
            say(
                f"poolipc: not enabled ({e}); install the wheel into ComfyUI's Python "
                "(python -m pip install poolipc-*.whl). ComfyUI starts as before."
            )
            return
        mps = os.environ.get("POOLIPC_MPS", "").strip().lower()
        if mps:
            # MPS must start before CUDA does, so here, before the pool swap. The value itself
            # is the acknowledgement: a worker's GPU fault ends ComfyUI's CUDA context too.
            if mps != "accept-shared-gpu-faults":
                say(
                    f"poolipc: POOLIPC_MPS={mps!r} ignored: MPS is started only with "
                    "POOLIPC_MPS=accept-shared-gpu-faults, because under MPS a GPU fault in any "
                    "worker ends the CUDA context of ComfyUI itself (docs/guide.md: MPS)"
                )
            else:
                try:
                    pipe = poolipc.start_mps(accept_shared_gpu_faults=True)  # logs its own line
                    state.mps = pipe
                except poolipc.MpsError as e:
                    say(f"poolipc: MPS not started ({e}); handoffs go on without it")
        # POOLIPC_ISOLATED=1: workers get no handle on ComfyUI's memory (docs/threat-model.md):
        # their tensors cross by a device-to-device copy into their own arena chunks.
        isolated = os.environ.get("POOLIPC_ISOLATED", "").strip().lower() in ("1", "true", "yes", "on")
        if isolated:
            info = poolipc.install_pool(device, isolated=True)  # logs its own line
        else:
            info = poolipc.install_pool(device)  # logs its own line
        effective = not isinstance(info, dict) or info.get("effective", True)
        record("installed" if effective else "host-staging", device=device,
               reason=None if effective else (info.get("reason") if isinstance(info, dict) else None))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - a Rust panic surfaces as a BaseException
        record("failed", device=state.device, reason=f"{type(e).__name__}: {e}")
        say(f"poolipc: not enabled: {type(e).__name__}: {e}. ComfyUI starts as before.")


_poolipc_prestartup()
