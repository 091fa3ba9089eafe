"""npugraph-backend."""

from npugraph_backend.__about__ import __version__

__all__ = ["__version__"]
