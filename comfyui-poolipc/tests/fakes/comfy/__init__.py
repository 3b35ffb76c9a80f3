"""A stand-in for ComfyUI's `comfy` package: only what the pack and these tests touch."""
