"""Re-inplacing: functional ops turned back into in-place ops where nobody can tell.

AOT hands us a functional graph. Each ``y = op(x, ...)`` allocates a new ``y``; each mutation of
a graph input ``p`` became ``new = op(p, ...)`` plus a ``copy_(p, new)`` epilogue, so a KV cache
updated with ``index_copy_`` is copied whole every step. Two passes undo that:

* :func:`inplace_pass` (intermediates): ``y = op(x, ...)`` becomes ``op_(x, ...)`` when ``x`` is
  an intermediate (no graph input, no view of one) that nothing reads afterwards;
* :func:`input_inplace_pass` (graph inputs): ``new = op(p, ...)`` + ``copy_(p, new)`` becomes
  ``op_(p, ...)`` and the epilogue goes; ``index_copy``, ``index_put``, ``scatter`` and every
  functional op with an in-place twin, ``slice_scatter``/``select_scatter``/``diagonal_scatter``/
  ``as_strided_scatter`` (a view of ``p`` plus ``copy_``), the generic epilogue
  ``copy_(p, f(...))`` where ``f`` has an ``out=`` variant (``f(..., out=p)``), and custom ops
  with mutable arguments (``auto_functionalized``: no clone of what may be written directly).

Both refuse when the old value is read afterwards (through any alias), when the shapes,
strides or dtypes differ (broadcasting, type promotion, another layout), when the written tensor
may overlap itself (:mod:`npugraph_passes.overlap`) or another argument, when a node on another
stream uses the tensor with no event between, and when a collective reads or writes the tensor
(its inputs, its result, what its wait returns). Collectives and their waits are never rewritten: a
functional collective stays functional (:mod:`npugraph_passes.collectives`).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from npugraph_passes import _compat
from npugraph_passes.aliasing import alias_base, node_storage, written_args
from npugraph_passes.collectives import CollectiveMemory, is_ordering_point
from npugraph_passes.noop import same_meta
from npugraph_passes.out_variants import out_overload
from npugraph_passes.overlap import may_self_overlap
from npugraph_passes.stream_safety import StreamMap

aten = torch.ops.aten

#: scatter op -> the view op it writes through.
SCATTER_VIEWS: dict[Any, Any] = {
    aten.slice_scatter.default: aten.slice.Tensor,
    aten.select_scatter.default: aten.select.int,
    aten.diagonal_scatter.default: aten.diagonal.default,
    aten.as_strided_scatter.default: aten.as_strided.default,
}

_VIEW_TARGETS = frozenset(SCATTER_VIEWS.values()) | {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default,
    aten.expand.default, aten.permute.default, aten.transpose.int, aten.t.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims,
    aten.as_strided.default, aten.unfold.default, aten.narrow.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default, aten.view.dtype,
}


def _val(node: object) -> torch.Tensor | None:
    if isinstance(node, torch.fx.Node):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val
    return None


def _meta_values(args: Any) -> Any:
    """``args`` with every node replaced by its ``meta["val"]`` (a SymInt start of a slice, a
    tensor): what the op is evaluated on to recompute a view's metadata."""
    return torch.fx.node.map_arg(args, lambda n: n.meta.get("val"))


class _Analysis:
    """Positions, storages and alias groups of one graph, kept up to date by the rewrites."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.position: dict[torch.fx.Node, int] = {n: i for i, n in enumerate(graph.nodes)}
        self.storage: dict[torch.fx.Node, int | None] = {}
        self.group: dict[int, set[torch.fx.Node]] = defaultdict(set)
        self.input_storages: set[int] = set()
        self.streams = StreamMap(graph)
        self.erased: set[torch.fx.Node] = set()
        self.output_node: torch.fx.Node = next(iter(reversed(graph.nodes)))
        for node in graph.nodes:
            key = node_storage(node)
            self.storage[node] = key
            if key is not None:
                self.group[key].add(node)
                if node.op in ("placeholder", "get_attr"):
                    self.input_storages.add(key)
        self.collectives = CollectiveMemory(graph, lambda n: self.storage.get(n))

    def collective_memory(self, target: torch.fx.Node) -> bool:
        """A collective reads or writes ``target``'s memory: no rewrite may write into it."""
        return self.collectives.touches(self.storage.get(target))

    def aliases(self, node: torch.fx.Node) -> set[torch.fx.Node]:
        key = self.storage.get(node)
        return set(self.group[key]) if key is not None else {node}

    def reads_after(self, node: torch.fx.Node, target: torch.fx.Node,
                    ignore: set[torch.fx.Node]) -> list[torch.fx.Node]:
        """Nodes after ``node`` that read ``target``'s storage through any alias (views that only
        feed other readers do not count themselves; their readers do)."""
        aliases = self.aliases(target)
        at = self.position[node]
        found: list[torch.fx.Node] = []
        for alias in aliases:
            for user in alias.users:
                if user is node or user in ignore or self.position.get(user, -1) <= at:
                    continue
                if user in aliases and user.target in _VIEW_TARGETS:
                    continue
                found.append(user)
        return found

    def is_returned(self, node: torch.fx.Node) -> bool:
        """``node``'s value (or a view of it) is a graph output."""
        if self.output_node.op != "output":
            return False
        key = self.storage.get(node)
        returned: list[torch.fx.Node] = []
        torch.fx.node.map_arg(self.output_node.args, returned.append)
        return any(r is node or (key is not None and self.storage.get(r) == key) for r in returned)

    def users_of(self, target: torch.fx.Node) -> list[torch.fx.Node]:
        return [u for a in self.aliases(target) for u in a.users]

    def written_between(self, target: torch.fx.Node, lo: int, hi: int, ignore: set[torch.fx.Node]) -> bool:
        key = self.storage.get(target)
        for node in self.graph.nodes:
            if node in ignore or not (lo < self.position.get(node, -1) < hi):
                continue
            for dst in written_args(node):
                if self.storage.get(dst) == key:
                    return True
        return False

    def erase(self, node: torch.fx.Node) -> None:
        self.graph.erase_node(node)
        self.erased.add(node)
        key = self.storage.pop(node, None)
        if key is not None:
            self.group[key].discard(node)

    def merge(self, node: torch.fx.Node, into: torch.fx.Node) -> None:
        """``node`` now returns ``into``'s storage."""
        old = self.storage.get(node)
        if old is not None:
            self.group[old].discard(node)
        key = self.storage.get(into)
        self.storage[node] = key
        if key is not None:
            self.group[key].add(node)


def _refresh_views(root: torch.fx.Node, an: _Analysis) -> None:
    """Views of ``root`` whose meta still describes the tensor ``root`` replaced get their
    ``meta["val"]`` recomputed, so later passes see the real aliasing."""
    key = an.storage.get(root)
    todo = [u for u in root.users if u.target in _VIEW_TARGETS]
    seen: set[torch.fx.Node] = set()
    while todo:
        view = todo.pop()
        if view in seen or not isinstance(view.args[0], torch.fx.Node):
            continue
        seen.add(view)
        base = _val(view.args[0])
        if base is None or an.storage.get(view) == key:
            continue
        args = (base, *_meta_values(view.args[1:]))
        try:
            view.meta["val"] = view.target(*args, **_meta_values(view.kwargs))  # type: ignore[operator]
        except Exception:
            continue
        an.merge(view, root)
        todo.extend(u for u in view.users if u.target in _VIEW_TARGETS)


def _written_view(node: torch.fx.Node, buf: torch.Tensor) -> torch.Tensor | None:
    """The part of ``buf`` a ``*_scatter`` node writes (``buf`` itself for other ops); None when
    it cannot be computed."""
    if node.target not in SCATTER_VIEWS:
        return buf
    try:
        view: torch.Tensor = SCATTER_VIEWS[node.target](buf, *_meta_values(node.args[2:]),
                                                        **_meta_values(node.kwargs))
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


def _fits_in_place(node: torch.fx.Node, dst: torch.fx.Node) -> bool:
    """``node``'s result may live in ``dst``: same shape, strides (a later ``as_strided`` or
    ``view`` reads the layout), dtype and device, and every element written has memory of its
    own (no write into an ``expand``/``unfold``/``as_strided`` whose elements overlap)."""
    out, buf = _val(node), _val(dst)
    if out is None or buf is None:
        return False
    if not (
        _compat.statically_known_true(_compat.sym_eq(out.shape, buf.shape))
        and out.dtype == buf.dtype
        and out.device == buf.device
        and not may_self_overlap(buf)
    ):
        return False
    if not _same_layout(out, buf):
        return False
    written = _written_view(node, buf)
    return written is not None and not may_self_overlap(written)


def _others_alias(node: torch.fx.Node, dst: torch.fx.Node, an: _Analysis, skip_first: bool = True) -> bool:
    key = an.storage.get(dst)
    args = list(node.args)
    rest = args[1:] if skip_first else args
    nodes: list[torch.fx.Node] = []
    torch.fx.node.map_arg((rest, node.kwargs), nodes.append)
    return any(n is dst or (key is not None and an.storage.get(n) == key) for n in nodes)


def _streams_ok(node: torch.fx.Node, dst: torch.fx.Node, an: _Analysis) -> bool:
    if not an.streams.multi_stream:
        return True
    return an.streams.all_ordered(node, an.users_of(dst) + list(node.users))


def _rewrite_in_place(node: torch.fx.Node, dst: torch.fx.Node, an: _Analysis) -> bool:
    """Makes ``node`` write into ``dst`` (its first argument) and return it. False if ``node``'s
    op has no in-place form."""
    graph = an.graph
    if node.target in SCATTER_VIEWS:
        view_op = SCATTER_VIEWS[node.target]
        src = node.args[1]
        view_args = node.args[2:]
        with graph.inserting_before(node):
            view = graph.call_function(view_op, (dst, *view_args), dict(node.kwargs))
            dst_val = _val(dst)
            if dst_val is not None:
                view.meta["val"] = view_op(dst_val, *_meta_values(view_args),
                                           **_meta_values(node.kwargs))
            view.meta["stack_trace"] = node.meta.get("stack_trace")
            # copy(view_of_dst, v) feeding only this scatter is v converted to the view: copy_ does it.
            if (isinstance(src, torch.fx.Node) and src.target is aten.copy.default
                    and len(src.users) == 1 and isinstance(src.args[0], torch.fx.Node)
                    and src.args[0].target is view_op and src.args[0].args[1:] == tuple(view_args)
                    and src.args[0].args[0] is dst):
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
        _refresh_views(dst, an)
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
    node.replace_all_uses_with(dst, delete_user_cb=lambda user: user is not node)
    if (val := _val(dst)) is not None:
        node.meta["val"] = val
    an.merge(node, dst)
    _refresh_views(dst, an)
    return True


def _intermediate_candidate(node: torch.fx.Node, an: _Analysis) -> torch.fx.Node | None:
    if node.op != "call_function" or not isinstance(node.target, _compat.OpOverload):
        return None
    if is_ordering_point(node) or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    if node.target not in SCATTER_VIEWS and _compat.inplace_overload(node.target) is None:
        return None
    dst = node.args[0]
    return dst if dst.op == "call_function" else None


def inplace_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
    """Re-inplaces functional ops on intermediates nobody reads afterwards. Needs
    ``node.meta["val"]``; nodes without it are left alone."""
    an = _Analysis(gm.graph)
    for node in list(gm.graph.nodes):
        if node in an.erased:
            continue
        dst = _intermediate_candidate(node, an)
        if dst is None:
            continue
        key = an.storage.get(dst)
        if key is None or key in an.input_storages:
            continue
        if not _fits_in_place(node, dst) or _others_alias(node, dst, an):
            continue
        if an.reads_after(node, dst, ignore=set()):
            continue
        if not _streams_ok(node, dst, an) or an.collective_memory(dst):
            continue
        _rewrite_in_place(node, dst, an)


def _epilogues(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [
        n for n in graph.nodes
        if n.op == "call_function" and n.target is aten.copy_.default and len(n.args) >= 2
        and isinstance(n.args[0], torch.fx.Node) and n.args[0].op in ("placeholder", "get_attr")
        and isinstance(n.args[1], torch.fx.Node) and n.args[1].op == "call_function"
    ]


def _input_in_place(src: torch.fx.Node, dst: torch.fx.Node, copy: torch.fx.Node, an: _Analysis) -> bool:
    """``new = op(dst, ...)`` + ``copy_(dst, new)`` -> ``op_(dst, ...)``."""
    if not isinstance(src.target, _compat.OpOverload) or not src.args or src.args[0] is not dst:
        return False
    if is_ordering_point(src):
        return False
    if src.target not in SCATTER_VIEWS and _compat.inplace_overload(src.target) is None:
        return False
    if not _fits_in_place(src, dst) or _others_alias(src, dst, an):
        return False
    # A returned result would become the input itself: new aliasing between input and output.
    if an.is_returned(src):
        return False
    if an.reads_after(src, dst, ignore={copy}):
        return False
    if an.written_between(dst, an.position[src], an.position[copy], ignore={copy}):
        return False
    if not _streams_ok(src, dst, an) or an.collective_memory(dst):
        return False
    return _rewrite_in_place(src, dst, an)


def _input_out_variant(src: torch.fx.Node, dst: torch.fx.Node, copy: torch.fx.Node, an: _Analysis) -> bool:
    """``new = f(a, b)`` + ``copy_(dst, new)`` -> ``f.out(a, b, out=dst)`` when ``f`` has one."""
    out_op = out_overload(src.target)
    if out_op is None or "out" in src.kwargs or alias_base(src) is not None or is_ordering_point(src):
        return False
    if not _fits_in_place(src, dst) or _others_alias(src, dst, an, skip_first=False):
        return False
    if an.is_returned(src):
        return False
    # dst now changes at src instead of at the epilogue: nobody may read it in between.
    if an.reads_after(src, dst, ignore={copy}) or an.written_between(dst, an.position[src], an.position[copy], {copy}):
        return False
    if any(an.position.get(u, -1) < an.position[src] for u in src.users):
        return False
    if not _streams_ok(src, dst, an) or an.collective_memory(dst):
        return False
    src.target = out_op
    src.kwargs = {**src.kwargs, "out": dst}
    src.replace_all_uses_with(dst, delete_user_cb=lambda user: user is not src)
    if (val := _val(dst)) is not None:
        src.meta["val"] = val
    an.merge(src, dst)
    _refresh_views(dst, an)
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


def _hop_slots(node: torch.fx.Node) -> list[tuple[object, torch.fx.Node, int]]:
    """(clone key, mutated tensor, output index of its new value) for each mutated tensor of an
    auto_functionalized node; [] when we do not know the node's layout."""
    v1, v2 = _compat.auto_functionalized_ops()
    op = node.args[0] if node.args else None
    if not isinstance(op, _compat.OpOverload) or node.target not in (v1, v2) or node.target is None:
        return []
    schema = _compat.op_schema(op)
    if any(a.kwarg_only and a.name == "out" for a in schema.arguments):
        return []  # out= ops return only their out tensors: another layout
    n_out = len(schema.returns) if len(schema.returns) > 1 else 1
    slots: list[tuple[object, torch.fx.Node, int]] = []
    if node.target is v2:
        bases = node.kwargs.get("_all_bases", [])
        for i, base in enumerate(bases if isinstance(bases, (list, tuple)) else []):
            if not isinstance(base, torch.fx.Node):
                return []
            slots.append((i, base, n_out + i))
        return slots
    names = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    for j, name in enumerate(names):
        value = node.kwargs.get(name)
        if value is None:
            continue
        if not isinstance(value, torch.fx.Node):
            return []
        slots.append((name, value, n_out + j))
    return slots


def _hop_can_write(node: torch.fx.Node, base: torch.fx.Node, index: int, an: _Analysis) -> torch.fx.Node | bool:
    """Whether the op may write ``base`` itself instead of a clone: False, True, or the epilogue
    ``copy_(base, new)`` that becomes redundant when it does."""
    news = [u for u in node.users if u.target is operator.getitem and u.args[1] == index]
    key = an.storage.get(base)
    if key is None or any(an.is_returned(n) for n in news):
        return False
    others: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), others.append)
    if sum(1 for o in others if an.storage.get(o) == key) != 1:
        return False  # another argument shares the memory: the op would see its own writes
    epilogue: torch.fx.Node | None = None
    if key in an.input_storages:
        copies = [u for n in news for u in n.users
                  if u.target is aten.copy_.default and u.args[0] is base and u.args[1] is n]
        if base.op not in ("placeholder", "get_attr") or len(copies) != 1:
            return False
        epilogue = copies[0]
        if an.written_between(base, an.position[node], an.position[epilogue], {epilogue}):
            return False
    if an.reads_after(node, base, ignore={epilogue} if epilogue is not None else set()):
        return False
    if an.collective_memory(base):
        return False
    val = _val(base)
    if val is None or may_self_overlap(val):
        return False
    if an.streams.multi_stream and not an.streams.all_ordered(
        node, an.users_of(base) + [u for n in news for u in n.users]
    ):
        return False
    return epilogue if epilogue is not None else True


def _reinplace_auto_functionalized(gm: torch.fx.GraphModule, an: _Analysis) -> None:
    """Custom ops with mutable arguments: AOT wraps them in auto_functionalized, which clones
    every mutated tensor. Tensors that may be written directly are left out of the clones and
    inductor's decomposition turns the node into the mutating op."""
    v1, v2 = _compat.auto_functionalized_ops()
    decided = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is None or node.target not in (v1, v2):
            continue
        slots = _hop_slots(node)
        if not slots:
            continue
        clone: list[object] = []
        for key, base, index in slots:
            if not _hop_can_write(node, base, index, an):
                clone.append(key)
        if len(clone) < len(slots):
            node.meta["only_clone_these_tensors"] = clone
            decided = True
    if not decided:
        return
    _compat.decompose_auto_functionalized(gm.graph)
    for node in list(gm.graph.nodes):
        if (node.target is aten.copy_.default and len(node.args) >= 2 and node.args[0] is node.args[1]
                and not node.users):
            gm.graph.erase_node(node)


def lower_auto_functionalized(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
    """Every ``auto_functionalized`` node left in the graph becomes clones plus the mutating op
    (inductor's decomposition; clones all mutated tensors unless input_inplace_pass decided
    otherwise). Always run: a higher-order op cannot be recorded by a device-graph capture."""
    v1, v2 = _compat.auto_functionalized_ops()
    targets = {t for t in (v1, v2) if t is not None}
    if not any(n.op == "call_function" and n.target in targets for n in gm.graph.nodes):
        return
    _compat.decompose_auto_functionalized(gm.graph)


def input_inplace_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
    """Turns ``copy_(input, op(input, ...))`` epilogues into in-place updates of the input (and
    ``copy_(input, f(...))`` into ``f(..., out=input)``), so a mutated input is written where it
    changes instead of being copied whole at the end."""
    graph = gm.graph
    an = _Analysis(graph)
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
    _reinplace_auto_functionalized(gm, an)
