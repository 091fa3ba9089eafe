"""Whether a node's result may be written into a tensor it reads, and the rewrite that makes it
so: the checks and the graph surgery the re-inplacing passes share
(see :mod:`npugraph_passes.reinplace`)."""

from __future__ import annotations

import operator

import torch
import torch.fx

from npugraph_passes import _compat
from npugraph_passes.aliasing import alias_base, written_args
from npugraph_passes.inplace_analysis import (
    SCATTER_VIEWS,
    VIEW_TARGETS,
    Analysis,
    meta_tensor,
    meta_values,
    same_view,
)
from npugraph_passes.overlap import may_self_overlap

__all__ = ["fits_in_place", "others_alias", "refresh_views", "rewrite_in_place", "streams_ok", "writes_into"]

aten = torch.ops.aten


def _views(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The users of ``node`` that are views of it: the known view ops, any op whose schema says
    its result aliases ``node`` without writing it, and items of a list of views (``detach``,
    ``split(...)[i]``: a reinplaced tensor's detached view left in the old storage would let a
    later op be reinplaced into it, writing a returned tensor)."""
    return [u for u in node.users if u.target in VIEW_TARGETS or (not written_args(u) and (
        alias_base(u) is node
        # one view of a list of views (split): its alias_base is the list's base
        or (u.target is operator.getitem and alias_base(u) is not None)))]


def refresh_views(root: torch.fx.Node, an: Analysis) -> None:
    """Views of ``root`` whose meta still describes the tensor ``root`` replaced get their
    ``meta["val"]`` recomputed, so later passes see the real aliasing."""
    key = an.storage.get(root)
    todo = _views(root)
    seen: set[torch.fx.Node] = set()
    while todo:
        view = todo.pop()
        if view in seen or not isinstance(view.args[0], torch.fx.Node):
            continue
        seen.add(view)
        base = view.args[0].meta.get("val")  # a list for a getitem of split's views
        if not isinstance(base, torch.Tensor | list | tuple) or an.storage.get(view) == key:
            continue
        args = (base, *meta_values(view.args[1:]))
        try:
            view.meta["val"] = view.target(*args, **meta_values(view.kwargs))  # type: ignore[operator]
        except Exception:
            continue
        an.merge(view, root)
        todo.extend(_views(view))


def _written_view(node: torch.fx.Node, buf: torch.Tensor) -> torch.Tensor | None:
    """The part of ``buf`` a ``*_scatter`` node writes (``buf`` itself for other ops); None when
    it cannot be computed."""
    if node.target not in SCATTER_VIEWS:
        return buf
    try:
        view: torch.Tensor = SCATTER_VIEWS[node.target](buf, *meta_values(node.args[2:]),
                                                        **meta_values(node.kwargs))
    except Exception:
        return None
    return view


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal strides where they matter: a dimension of size 1 places no element by its stride."""
    for size, sa, sb in zip(a.shape, a.stride(), b.stride(), strict=True):
        if _compat.statically_known_true(size == 1):
            continue
        if not _compat.statically_known_true(sa == sb):
            return False
    return True


def fits_in_place(node: torch.fx.Node, dst: torch.fx.Node, any_layout: bool = False) -> bool:
    """``node``'s result may live in ``dst``: same shape, strides (a later ``as_strided`` or
    ``view`` reads the layout; ``any_layout`` when no reader of the result sees it), dtype and
    device, and every element written has memory of its own (no write into an
    ``expand``/``unfold``/``as_strided`` whose elements overlap)."""
    out, buf = meta_tensor(node), meta_tensor(dst)
    if out is None or buf is None:
        return False
    if not (
        _compat.statically_known_true(_compat.sym_eq(out.shape, buf.shape))
        and out.dtype == buf.dtype
        and out.device == buf.device
        and not may_self_overlap(buf)
    ):
        return False
    if not any_layout and not _same_layout(out, buf):
        return False
    written = _written_view(node, buf)
    return written is not None and not may_self_overlap(written)


def others_alias(node: torch.fx.Node, dst: torch.fx.Node, an: Analysis, skip_first: bool = True) -> bool:
    key = an.storage.get(dst)
    args = list(node.args)
    rest = args[1:] if skip_first else args
    nodes: list[torch.fx.Node] = []
    torch.fx.node.map_arg((rest, node.kwargs), nodes.append)
    return any(n is dst or (key is not None and an.storage.get(n) == key) for n in nodes)


def streams_ok(node: torch.fx.Node, dst: torch.fx.Node, an: Analysis) -> bool:
    if not an.streams.multi_stream:
        return True
    return an.streams.all_ordered(node, an.users_of(dst) + list(node.users))


def rewrite_in_place(node: torch.fx.Node, dst: torch.fx.Node, an: Analysis) -> bool:
    """Makes ``node`` write into ``dst`` (its first argument) and return it. False if ``node``'s
    op has no in-place form."""
    graph = an.graph
    if node.target in SCATTER_VIEWS:
        view_op = SCATTER_VIEWS[node.target]
        src = node.args[1]
        view_args = node.args[2:]
        with graph.inserting_before(node):
            view = graph.call_function(view_op, (dst, *view_args), dict(node.kwargs))
            dst_val = meta_tensor(dst)
            if dst_val is not None:
                view.meta["val"] = view_op(dst_val, *meta_values(view_args),
                                           **meta_values(node.kwargs))
            view.meta["stack_trace"] = node.meta.get("stack_trace")
            # copy(view_of_dst, v) feeding only this scatter is v converted to the view: copy_ does it.
            if (isinstance(src, torch.fx.Node) and src.target is aten.copy.default
                    and len(src.users) == 1 and same_view(src.args[0], view)):
                src = src.args[1]
            copy = graph.call_function(aten.copy_.default, (view, src))
            copy.meta["val"] = view.meta.get("val")
            copy.meta["stack_trace"] = node.meta.get("stack_trace")
        an.position[view] = an.position[node]
        an.position[copy] = an.position[node]
        an.storage[view] = an.storage.get(dst)
        an.storage[copy] = an.storage.get(dst)
        original_src = node.args[1]
        node.replace_all_uses_with(dst)
        an.erase(node)
        refresh_views(dst, an)
        if src is not original_src and isinstance(original_src, torch.fx.Node) and not original_src.users:
            old_view = original_src.args[0]
            an.erase(original_src)
            if isinstance(old_view, torch.fx.Node) and not old_view.users:
                an.erase(old_view)
        return True
    inplace = _compat.inplace_overload(node.target)
    if inplace is None:
        return False
    node.target = inplace
    writes_into(node, dst, an)
    return True


def writes_into(node: torch.fx.Node, dst: torch.fx.Node, an: Analysis) -> None:
    """``node`` (retargeted to write ``dst``) now returns ``dst``: its users read ``dst``."""
    node.replace_all_uses_with(dst, delete_user_cb=lambda user: user is not node)
    if (val := meta_tensor(dst)) is not None:
        node.meta["val"] = val
    an.merge(node, dst)
    refresh_views(dst, an)
