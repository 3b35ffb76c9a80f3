"""Stand-in: see the package's docstring."""

from . import functional  # noqa: F401
