"""ComfyUI's comfy.model_management, reduced to what the pack touches (no torch)."""


class Device:
    def __init__(self, type, index=None):
        self.type, self.index = type, index

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"


DEVICE = Device("cuda", 0)
CALLS = []


def get_torch_device():
    return DEVICE


def unload_all_models():
    CALLS.append("unload_all_models")


def soft_empty_cache(force=False):
    CALLS.append("soft_empty_cache")
