"""npugraph-passes: FX rewrites for captured inference graphs and the PassManager that runs them.

The names are imported on first use: a warm start from the compile cache needs only the
PassManager's identity, not the passes (see manager._BUILTIN_MODULES)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from npugraph_passes.__about__ import __version__
from npugraph_passes.errors import PassConfigError, PassError

if TYPE_CHECKING:
    from npugraph_passes.cat import remove_cat_ops
    from npugraph_passes.cleanup import dead_code_elimination
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

# name -> the module that defines it
_LAZY: dict[str, str] = {
    "remove_cat_ops": "npugraph_passes.cat",
    "dead_code_elimination": "npugraph_passes.cleanup",
    "fwd_only": "npugraph_passes.fusion",
    "pattern_fusion_pass": "npugraph_passes.fusion",
    "register_replacement": "npugraph_passes.fusion",
    "UnsafeNode": "npugraph_passes.lint",
    "capture_safety_lint": "npugraph_passes.lint",
    "find_unsafe_nodes": "npugraph_passes.lint",
    "GraphPass": "npugraph_passes.manager",
    "PassManager": "npugraph_passes.manager",
    "PassRecord": "npugraph_passes.manager",
    "remove_noop_ops": "npugraph_passes.noop",
    "inplace_pass": "npugraph_passes.reinplace",
    "input_inplace_pass": "npugraph_passes.reinplace",
    "bytes_copied_per_step": "npugraph_passes.stats",
    "graph_stats": "npugraph_passes.stats",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'npugraph_passes' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
