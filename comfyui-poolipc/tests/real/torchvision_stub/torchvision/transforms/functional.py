"""Stand-in: see the package's docstring. ComfyUI's LaMa imports these two names."""

import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def rotate(*args, **kwargs):
    from .. import _refuse

    _refuse("transforms.functional.rotate")
