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
from npugraph_passes.inplace_analysis import (
    SCATTER_VIEWS,
    VIEW_TARGETS,
    Analysis,
    input_view_root,
    meta_tensor,
    meta_values,
    same_layout,
    same_view,
)
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
    """``copy_(p, new)`` where ``p`` is a graph input or a view of one: AOT's epilogues, and the
    writes into a view (``kc[layer]``) that a ``*_scatter`` of the input becomes."""
    return [
        n for n in graph.nodes
        if n.op == "call_function" and n.target is aten.copy_.default and len(n.args) >= 2
        and isinstance(n.args[0], torch.fx.Node) and input_view_root(n.args[0]) is not None
        and isinstance(n.args[1], torch.fx.Node) and n.args[1].op == "call_function"
    ]


def _read_later(src: torch.fx.Node, dst: torch.fx.Node, copy: torch.fx.Node, an: Analysis) -> bool:
    """A user of ``src`` after ``copy`` would, once ``src`` is ``dst``'s memory, see a write into
    ``dst`` made after ``copy``."""
    last = max((an.position.get(u, -1) for u in src.users if u is not copy), default=-1)
    return last > an.position[copy] and an.written_between(dst, an.position[copy], last + 1, ignore=set())


def _layout_unseen(node: torch.fx.Node, chain: list[torch.fx.Node], copy: torch.fx.Node) -> bool:
    """Only the chain (whose views ``_lands_on`` follows on the real layout) and the copy read
    ``node``'s result: an update may write a view of another layout than its functional result
    (``kc[l][slots, 2:4] = v``: an index_put into a strided slice)."""
    return all(u is copy or u in chain for u in node.users)


def _input_in_place(src: torch.fx.Node, copy: torch.fx.Node, an: Analysis, any_layout: bool = False) -> bool:
    """``new = op(v, ...)`` + ``copy_(dst, new)`` -> ``op_(v, ...)``, where ``v`` (``src``'s first
    argument) is ``dst``'s memory or part of it (``_lands_on`` checked which)."""
    base = src.args[0] if src.args else None
    if not isinstance(src.target, _compat.OpOverload) or not isinstance(base, torch.fx.Node):
        return False
    if is_ordering_point(src):
        return False
    if src.target not in SCATTER_VIEWS and _compat.inplace_overload(src.target) is None:
        return False
    if not fits_in_place(src, base, any_layout) or others_alias(src, base, an):
        return False
    # A returned result would become the input itself: new aliasing between input and output.
    if an.is_returned(src):
        return False
    # the old value may not be read between the write's new place and its old one
    if an.reads_after(src, base, ignore={copy}, before=copy) or _read_later(src, base, copy, an):
        return False
    if an.written_between(base, an.position[src], an.position[copy], ignore={copy}):
        return False
    if not streams_ok(src, base, an) or an.collective_memory(base):
        return False
    return rewrite_in_place(src, base, an)


def _input_out_variant(src: torch.fx.Node, dst: torch.fx.Node, copy: torch.fx.Node, an: Analysis) -> bool:
    """``new = f(a, b)`` + ``copy_(dst, new)`` -> ``f.out(a, b, out=dst)`` when ``f`` has one."""
    out_op = out_overload(src.target)
    if out_op is None or "out" in src.kwargs or alias_base(src) is not None or is_ordering_point(src):
        return False
    # ``out=`` must name a tensor that exists when src runs
    if an.position[dst] > an.position[src]:
        return False
    if not fits_in_place(src, dst) or others_alias(src, dst, an, skip_first=False):
        return False
    if an.is_returned(src):
        return False
    # dst now changes at src instead of at the epilogue: nobody may read it in between.
    if an.reads_after(src, dst, ignore={copy}, before=copy) or _read_later(src, dst, copy, an) \
            or an.written_between(dst, an.position[src], an.position[copy], {copy}):
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
    """``[op_1, ..., op_k = src]`` when ``src = op_k(...op_1(v, ...)...)`` with ``v`` the same
    view of the same input as ``dst``, and every op but the last feeds only the next one (several
    updates of one input; views between them, as in ``view(index_copy(view(kc[l])), kc[l].shape)``
    for a write through ``kc[l].view(-1, d)``); [] otherwise."""
    chain = [src]
    node = src
    while node.args and not same_view(node.args[0], dst):
        prev = node.args[0]
        if not isinstance(prev, torch.fx.Node) or prev.op != "call_function" or len(prev.users) != 1:
            return []
        chain.append(prev)
        node = prev
    return chain[::-1] if node.args else []


def _lands_on(chain: list[torch.fx.Node], dst: torch.fx.Node, copy: torch.fx.Node) -> bool:
    """With each update of ``chain`` made in place, its last node is ``dst``'s memory element for
    element: the updates fit the tensors they read, and the views between them lead back to
    ``dst``'s layout."""
    t = meta_tensor(chain[0].args[0])
    want = meta_tensor(dst)
    for node in chain:
        if t is None or want is None:
            return False
        if node.target in VIEW_TARGETS:
            try:
                t = node.target(t, *meta_values(node.args[1:]), **meta_values(node.kwargs))  # type: ignore[operator]
            except Exception:
                return False
        elif not isinstance(node.args[0], torch.fx.Node) or not fits_in_place(
                node, node.args[0], _layout_unseen(node, chain, copy)):
            return False
    return t is not None and want is not None and same_layout(t, want)


def _same_memory(a: object, b: torch.fx.Node, an: Analysis) -> bool:
    if same_view(a, b):
        return True
    ta, tb = meta_tensor(a), meta_tensor(b)
    return (isinstance(a, torch.fx.Node) and ta is not None and tb is not None
            and an.storage.get(a) is not None and an.storage.get(a) == an.storage.get(b) and same_layout(ta, tb))


def _reinplace_epilogue(copy: torch.fx.Node, an: Analysis) -> None:
    dst, src = copy.args[0], copy.args[1]
    assert isinstance(dst, torch.fx.Node) and isinstance(src, torch.fx.Node)
    if copy.users or an.storage.get(dst) is None:
        return
    # ``dst.copy_(x)`` traces to copy(dst, x) + epilogue; with equal metadata copy(dst, x)
    # is x itself, and the epilogue can then make x's producer write into dst.
    x = src.args[1] if src.target is aten.copy.default and len(src.args) > 1 else None
    if src.args and same_view(src.args[0], dst) and isinstance(x, torch.fx.Node) and same_meta(src, x):
        src.replace_all_uses_with(x)
        an.erase(src)
        src = x
    chain = _update_chain(src, dst)
    if chain and _lands_on(chain, dst, copy):
        # op_k(...op_1(dst)) + copy_(dst, op_k): each op in turn becomes op_(dst), first one
        # first (views between them stay views, now of the updated memory).
        done = all(node.target in VIEW_TARGETS
                   or _input_in_place(node, copy, an, _layout_unseen(node, chain, copy)) for node in chain)
    else:
        done = _input_out_variant(src, dst, copy, an)
    last = copy.args[1]
    if done and _same_memory(last, dst, an) and not copy.users:
        an.erase(copy)
        for node in (last, dst):
            if isinstance(node, torch.fx.Node) and not node.users and node.op == "call_function" \
                    and node.target in VIEW_TARGETS:
                an.erase(node)


def input_inplace_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
    """Turns ``copy_(input, op(input, ...))`` epilogues into in-place updates of the input (and
    ``copy_(input, f(...))`` into ``f(..., out=input)``), so a mutated input is written where it
    changes instead of being copied whole at the end."""
    graph = gm.graph
    an = Analysis(graph)
    tried: set[torch.fx.Node] = set()
    # rewriting a ``*_scatter`` makes a new ``copy_`` into a view: those are tried in turn
    while todo := [c for c in _epilogues(graph) if c not in tried]:
        for copy in todo:
            tried.add(copy)
            if copy not in an.erased:
                _reinplace_epilogue(copy, an)
    reinplace_auto_functionalized(gm, an)
