"""What the re-inplacing passes know of a graph: which nodes share storage (alias groups),
where each node is, which storages are graph inputs, streams and collectives; kept up to date by
the rewrites (see :mod:`npugraph_passes.reinplace`)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.fx

from npugraph_passes import _compat
from npugraph_passes.aliasing import node_storage, written_args
from npugraph_passes.collectives import CollectiveMemory
from npugraph_passes.stream_safety import StreamMap

__all__ = ["SCATTER_VIEWS", "VIEW_TARGETS", "Analysis", "input_view_root", "meta_tensor", "meta_values",
           "same_layout", "same_view"]

aten = torch.ops.aten


#: scatter op -> the view op it writes through.
SCATTER_VIEWS: dict[Any, Any] = {
    aten.slice_scatter.default: aten.slice.Tensor,
    aten.select_scatter.default: aten.select.int,
    aten.diagonal_scatter.default: aten.diagonal.default,
    aten.as_strided_scatter.default: aten.as_strided.default,
}

VIEW_TARGETS = frozenset(SCATTER_VIEWS.values()) | {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default,
    aten.expand.default, aten.permute.default, aten.transpose.int, aten.t.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims,
    aten.as_strided.default, aten.unfold.default, aten.narrow.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default, aten.view.dtype,
}


def same_view(a: object, b: object) -> bool:
    """``a`` and ``b`` are the same memory by construction: the same node, or the same view op
    with the same arguments applied to the same view (``kc[l]`` written twice in a graph is two
    ``select(kc, 0, l)`` nodes)."""
    if a is b:
        return True
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return False
    if a.op != "call_function" or a.target not in VIEW_TARGETS or a.target is not b.target:
        return False
    if a.args[1:] != b.args[1:] or a.kwargs != b.kwargs:
        return False
    return same_view(a.args[0], b.args[0])


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` (views of one storage) place every element at the same address."""
    return bool(
        _compat.statically_known_true(_compat.sym_eq(a.shape, b.shape))
        and _compat.statically_known_true(_compat.sym_eq(a.stride(), b.stride()))
        and _compat.statically_known_true(a.storage_offset() == b.storage_offset())
    )


def input_view_root(node: torch.fx.Node) -> torch.fx.Node | None:
    """The graph input ``node`` is (a placeholder, a parameter) or is a chain of views of; None
    for anything else."""
    seen = 0
    while node.op == "call_function" and node.target in VIEW_TARGETS and seen < 10_000:
        base = node.args[0] if node.args else None
        if not isinstance(base, torch.fx.Node):
            return None
        node = base
        seen += 1
    return node if node.op in ("placeholder", "get_attr") else None


def meta_tensor(node: object) -> torch.Tensor | None:
    if isinstance(node, torch.fx.Node):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val
    return None


def meta_values(args: Any) -> Any:
    """``args`` with every node replaced by its ``meta["val"]`` (a SymInt start of a slice, a
    tensor): what the op is evaluated on to recompute a view's metadata."""
    return torch.fx.node.map_arg(args, lambda n: n.meta.get("val"))


class Analysis:
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
                    ignore: set[torch.fx.Node], before: torch.fx.Node | None = None) -> list[torch.fx.Node]:
        """Nodes after ``node`` (and before ``before``, when given) that read ``target``'s storage
        through any alias (views that only feed other readers do not count themselves; their
        readers do)."""
        aliases = self.aliases(target)
        at = self.position[node]
        until = self.position[before] if before is not None else len(self.position) + 1
        found: list[torch.fx.Node] = []
        for alias in aliases:
            for user in alias.users:
                if user is node or user in ignore or not at < self.position.get(user, -1) < until:
                    continue
                if user in aliases and user.target in VIEW_TARGETS:
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
