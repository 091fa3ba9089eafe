"""npugraph-passes: FX rewrites for captured inference graphs and the PassManager that runs them."""

from npugraph_passes.__about__ import __version__
from npugraph_passes.errors import PassError
from npugraph_passes.lint import UnsafeNode, find_unsafe_nodes
from npugraph_passes.manager import GraphPass, PassManager, PassRecord
from npugraph_passes.noop import remove_noop_ops

__all__ = [
    "GraphPass",
    "PassError",
    "PassManager",
    "PassRecord",
    "UnsafeNode",
    "__version__",
    "find_unsafe_nodes",
    "remove_noop_ops",
]
