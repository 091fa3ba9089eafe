"""npugraph-ex: the public façade."""

from npugraph_ex.__about__ import __version__

__all__ = ["__version__"]
