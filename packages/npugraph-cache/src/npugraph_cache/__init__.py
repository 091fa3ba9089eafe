"""npugraph-cache."""

from npugraph_cache.__about__ import __version__

__all__ = ["__version__"]
