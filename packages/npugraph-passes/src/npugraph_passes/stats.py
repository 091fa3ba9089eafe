"""Numbers about a graph for benchmarks and reports: node counts and bytes copied per step."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from npugraph_passes.aliasing import node_storage, written_args

aten = torch.ops.aten


def graph_stats(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """``{"nodes": total, "by_op": {placeholder: n, call_function: n, ...}, "by_target":
    {"aten.mm.default": n, ...}}`` for ``gm``."""
    by_op: Counter[str] = Counter()
    by_target: Counter[str] = Counter()
    for node in gm.graph.nodes:
        by_op[node.op] += 1
        if node.op == "call_function":
            by_target[str(node.target)] += 1
    return {"nodes": len(gm.graph.nodes), "by_op": dict(by_op), "by_target": dict(by_target)}


def _nbytes(val: object) -> int:
    if isinstance(val, torch.Tensor):
        numel = val.numel()
        if isinstance(numel, int):
            return numel * val.element_size()
        hint = getattr(numel, "node", None)
        try:
            return int(numel) * val.element_size()
        except (TypeError, RuntimeError):
            return int(getattr(hint, "hint", 0) or 0) * val.element_size()
    return 0


def bytes_copied_per_step(gm: torch.fx.GraphModule, example_inputs: Sequence[Any] = ()) -> int:
    """Bytes written by ``copy_`` into graph inputs (or views of them) in one run of ``gm``: the
    cost of mutation epilogues (a KV cache copied whole is its whole size here). Sizes come from
    ``node.meta["val"]``, or from ``example_inputs`` for placeholders without it."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_placeholder = dict(zip(placeholders, example_inputs, strict=False))
    roots: dict[torch.fx.Node, torch.fx.Node] = {p: p for p in placeholders}
    for node in gm.graph.nodes:
        # Views of inputs are traced back to the input they alias.
        if node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
            src = node.args[0]
            key = node_storage(node)
            if src in roots and key is not None and key == node_storage(src) and node.target is not aten.copy_.default:
                roots[node] = roots[src]
    total = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.copy_.default:
            continue
        if not any(dst in roots for dst in written_args(node)):
            continue
        dst = node.args[0]
        assert isinstance(dst, torch.fx.Node)
        val = dst.meta.get("val")
        if not isinstance(val, torch.Tensor):
            val = by_placeholder.get(dst)
        total += _nbytes(val)
    return total
