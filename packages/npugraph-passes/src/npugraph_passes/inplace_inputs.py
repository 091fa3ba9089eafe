"""Re-inplacing graph inputs: the ``copy_(p, op(p, ...))`` epilogues AOT writes for a mutated
input become in-place updates of ``p``, or ``f(..., out=p)`` (see :mod:`npugraph_passes.reinplace`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from npugraph_passes import _compat
from npugraph_passes.aliasing import alias_base
from npugraph_passes.collectives import is_ordering_point
from npugraph_passes.inplace_analysis import SCATTER_VIEWS, Analysis
from npugraph_passes.inplace_custom_ops import reinplace_auto_functionalized
from npugraph_passes.inplace_rewrite import (
    fits_in_place,
    others_alias,
    rewrite_in_place,
    streams_ok,
    writes_into,
)
from npugraph_passes.noop import same_meta
from npugraph_passes.out_variants import out_overload

__all__ = ["input_inplace_pass"]

aten = torch.ops.aten


def _epilogues(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [
        n for n in graph.nodes
        if n.op == "call_function" and n.target is aten.copy_.default and len(n.args) >= 2
        and isinstance(n.args[0], torch.fx.Node) and n.args[0].op in ("placeholder", "get_attr")
        and isinstance(n.args[1], torch.fx.Node) and n.args[1].op == "call_function"
    ]


def _input_in_place(src: torch.fx.Node, dst: torch.fx.Node, copy: torch.fx.Node, an: Analysis) -> bool:
    """``new = op(dst, ...)`` + ``copy_(dst, new)`` -> ``op_(dst, ...)``."""
    if not isinstance(src.target, _compat.OpOverload) or not src.args or src.args[0] is not dst:
        return False
    if is_ordering_point(src):
        return False
    if src.target not in SCATTER_VIEWS and _compat.inplace_overload(src.target) is None:
        return False
    if not fits_in_place(src, dst) or others_alias(src, dst, an):
        return False
    # A returned result would become the input itself: new aliasing between input and output.
    if an.is_returned(src):
        return False
    if an.reads_after(src, dst, ignore={copy}):
        return False
    if an.written_between(dst, an.position[src], an.position[copy], ignore={copy}):
        return False
    if not streams_ok(src, dst, an) or an.collective_memory(dst):
        return False
    return rewrite_in_place(src, dst, an)


def _input_out_variant(src: torch.fx.Node, dst: torch.fx.Node, copy: torch.fx.Node, an: Analysis) -> bool:
    """``new = f(a, b)`` + ``copy_(dst, new)`` -> ``f.out(a, b, out=dst)`` when ``f`` has one."""
    out_op = out_overload(src.target)
    if out_op is None or "out" in src.kwargs or alias_base(src) is not None or is_ordering_point(src):
        return False
    if not fits_in_place(src, dst) or others_alias(src, dst, an, skip_first=False):
        return False
    if an.is_returned(src):
        return False
    # dst now changes at src instead of at the epilogue: nobody may read it in between.
    if an.reads_after(src, dst, ignore={copy}) or an.written_between(dst, an.position[src], an.position[copy], {copy}):
        return False
    if any(an.position.get(u, -1) < an.position[src] for u in src.users):
        return False
    if not streams_ok(src, dst, an) or an.collective_memory(dst):
        return False
    src.target = out_op
    src.kwargs = {**src.kwargs, "out": dst}
    writes_into(src, dst, an)
    return True


def _update_chain(src: torch.fx.Node, dst: torch.fx.Node) -> list[torch.fx.Node]:
    """``[op_1, ..., op_k = src]`` when ``src = op_k(...op_1(dst, ...)...)`` and every op but the
    last feeds only the next one (several updates of one input); [] otherwise."""
    chain = [src]
    node = src
    while node.args and node.args[0] is not dst:
        prev = node.args[0]
        if not isinstance(prev, torch.fx.Node) or prev.op != "call_function" or len(prev.users) != 1:
            return []
        chain.append(prev)
        node = prev
    return chain[::-1] if node.args else []


def input_inplace_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
    """Turns ``copy_(input, op(input, ...))`` epilogues into in-place updates of the input (and
    ``copy_(input, f(...))`` into ``f(..., out=input)``), so a mutated input is written where it
    changes instead of being copied whole at the end."""
    graph = gm.graph
    an = Analysis(graph)
    for copy in _epilogues(graph):
        dst, src = copy.args[0], copy.args[1]
        assert isinstance(dst, torch.fx.Node) and isinstance(src, torch.fx.Node)
        if copy.users or an.storage.get(dst) is None:
            continue
        # ``dst.copy_(x)`` traces to copy(dst, x) + epilogue; with equal metadata copy(dst, x)
        # is x itself, and the epilogue can then make x's producer write into dst.
        x = src.args[1] if src.target is aten.copy.default and len(src.args) > 1 else None
        if src.args and src.args[0] is dst and isinstance(x, torch.fx.Node) and same_meta(src, x):
            src.replace_all_uses_with(x)
            an.erase(src)
            src = x
        chain = _update_chain(src, dst)
        if chain:
            # op_k(...op_1(dst)) + copy_(dst, op_k): each op in turn becomes op_(dst), first one first.
            done = all(_input_in_place(node, dst, copy, an) for node in chain)
        else:
            done = _input_out_variant(src, dst, copy, an)
        if done and copy.args[1] is dst and not copy.users:
            an.erase(copy)
    reinplace_auto_functionalized(gm, an)
