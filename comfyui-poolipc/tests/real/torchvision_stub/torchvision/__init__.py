"""NOT torchvision: a stand-in that run.sh puts on the path only when the machine's Python
cannot import the real one. The mid-2024 ComfyUI imports torchvision at startup
(comfy/sd.py -> comfy/ldm/cascade/stage_c_coder.py, comfy_extras' LaMa) but uses it only
when a Stable Cascade or LaMa model is loaded, which the poolipc run never does. Anything
that really calls into it raises, naming this stub."""

from . import models, transforms  # noqa: F401  (ComfyUI reaches them as attributes)

__version__ = "0.0.0+poolipc-stub"
STUB = True


def _refuse(what):
    raise RuntimeError(
        f"torchvision.{what}: this is poolipc's stand-in for a missing torchvision "
        "(comfyui-poolipc/tests/real/torchvision_stub); install torchvision to use it"
    )
