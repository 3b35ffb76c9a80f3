"""ComfyUI's server module, reduced: nothing of it is used by the pack."""


class PromptServer:
    instance = None
