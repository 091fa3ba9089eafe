"""npugraph-passes: FX rewrites for captured inference graphs and the PassManager that runs them."""

from npugraph_passes.__about__ import __version__
from npugraph_passes.cat import remove_cat_ops
from npugraph_passes.cleanup import dead_code_elimination
from npugraph_passes.errors import PassConfigError, PassError
from npugraph_passes.fusion import fwd_only, pattern_fusion_pass, register_replacement
from npugraph_passes.lint import UnsafeNode, capture_safety_lint, find_unsafe_nodes
from npugraph_passes.manager import GraphPass, PassManager, PassRecord
from npugraph_passes.noop import remove_noop_ops
from npugraph_passes.reinplace import inplace_pass, input_inplace_pass
from npugraph_passes.stats import bytes_copied_per_step, graph_stats

__all__ = [
    "GraphPass",
    "PassConfigError",
    "PassError",
    "PassManager",
    "PassRecord",
    "UnsafeNode",
    "__version__",
    "bytes_copied_per_step",
    "capture_safety_lint",
    "dead_code_elimination",
    "find_unsafe_nodes",
    "fwd_only",
    "graph_stats",
    "inplace_pass",
    "input_inplace_pass",
    "pattern_fusion_pass",
    "register_replacement",
    "remove_cat_ops",
    "remove_noop_ops",
]
