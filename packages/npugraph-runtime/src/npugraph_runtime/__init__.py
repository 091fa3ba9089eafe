"""npugraph-runtime."""

from npugraph_runtime.__about__ import __version__

__all__ = ["__version__"]
