"""ComfyUI's folder_paths, reduced: custom_nodes and the user directory come from the
environment the test sets (FAKE_COMFY_CUSTOM_NODES, FAKE_COMFY_USER_DIR)."""
import os


def get_folder_paths(name):
    assert name == "custom_nodes", name
    return [os.environ["FAKE_COMFY_CUSTOM_NODES"]]


def get_user_directory():
    return os.environ.get("FAKE_COMFY_USER_DIR", "/nonexistent-comfy-user-dir")
