"""The package says its version, and it is the installed distribution's."""

import importlib.metadata

import poolipc


def test_the_version_is_the_distributions():
    assert poolipc.__version__ == importlib.metadata.version("poolipc")
    assert poolipc.__version__.count(".") == 2
