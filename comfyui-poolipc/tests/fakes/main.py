"""ComfyUI's main.py startup, reduced to the steps that matter to a prestartup script, in
either order: FAKE_COMFY_ORDER=new (cuda device and cuda_malloc, then prestartup scripts) or
old (prestartup scripts first). FAKE_COMFY_TORCH_EARLY=1 imports torch before all of it."""
import importlib.util
import json
import os
import sys

if os.environ.get("FAKE_COMFY_TORCH_EARLY") == "1":
    import torch  # noqa: F401

from comfy.cli_args import args  # noqa: E402
import folder_paths  # noqa: E402


def set_devices():
    if args.default_device is not None:
        devices = list(range(32))
        devices.remove(args.default_device)
        devices.insert(0, args.default_device)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    if args.cuda_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(args.cuda_device)


def execute_prestartup_script():
    # As ComfyUI's: os.listdir order (not sorted), the same skips, each script by file path.
    for custom_node_path in folder_paths.get_folder_paths("custom_nodes"):
        for possible_module in os.listdir(custom_node_path):
            module_path = os.path.join(custom_node_path, possible_module)
            if os.path.isfile(module_path) or module_path.endswith(".disabled") or module_path == "__pycache__":
                continue
            script_path = os.path.join(module_path, "prestartup_script.py")
            if os.path.exists(script_path):
                spec = importlib.util.spec_from_file_location(os.path.splitext(script_path)[0], script_path)
                module = importlib.util.module_from_spec(spec)
                try:
                    spec.loader.exec_module(module)
                except Exception as e:  # as ComfyUI: logged, startup goes on
                    print(f"Failed to execute startup-script: {script_path} / {e}", file=sys.stderr)


if os.environ["FAKE_COMFY_ORDER"] == "new":
    set_devices()
    import cuda_malloc  # noqa: F401
    execute_prestartup_script()
else:
    execute_prestartup_script()
    set_devices()
    import cuda_malloc  # noqa: F401,F811

if "torch" in sys.modules:
    print("WARNING: Torch already imported", file=sys.stderr)
import torch  # noqa: E402,F401,F811 - the fake one: prints what it saw

state = sys.modules.get("_poolipc_comfyui_startup")
print("STATE " + json.dumps({k: getattr(state, k, None) for k in ("mode", "device", "reason", "mps")}))
