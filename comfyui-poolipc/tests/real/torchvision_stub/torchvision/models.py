"""Stand-in: see the package's docstring."""


def efficientnet_v2_s(*args, **kwargs):
    from . import _refuse

    _refuse("models.efficientnet_v2_s")
