"""npugraph-passes."""

from npugraph_passes.__about__ import __version__

__all__ = ["__version__"]
