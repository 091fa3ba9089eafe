"""Dead-code elimination that keeps every side effect (mutations, RNG, our stream/scope markers)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from npugraph_passes._compat import OpOverload, OpOverloadPacket


def _is_npugraph_ex_op(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, (OpOverload, OpOverloadPacket)) and (
        target.namespace == "npugraph_ex"
    )


def _is_impure(node: torch.fx.Node) -> bool:
    # Stream/scope markers order the graph for the runtime even when nothing reads them.
    return _is_npugraph_ex_op(node) or node.is_impure()


def dead_code_elimination(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
    """Removes self-copies (``copy_(x, x)``) and nodes whose results are unused and that have
    no side effect."""
    for node in list(gm.graph.nodes):
        if (node.op == "call_function" and node.target is torch.ops.aten.copy_.default
                and len(node.args) >= 2 and node.args[0] is node.args[1] and not node.users):
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code(is_impure_node=_is_impure)
