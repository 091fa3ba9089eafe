"""Storage and mutation facts about FX nodes, read from ``node.meta["val"]``.

Every rewrite that changes which tensor a node reads or writes asks these questions first: which
storage does a node's value live in, which nodes write into a storage and where, and does a
storage belong to a graph input or a graph output.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.fx

from npugraph_passes._compat import OpOverload, storage_key


def node_storage(node: object) -> int | None:
    """The storage of a node's tensor value, or None when unknown (no meta, not a tensor)."""
    if not isinstance(node, torch.fx.Node):
        return None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return storage_key(val)


def written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The argument nodes an op writes into (schema alias annotations with ``!``: in-place
    ``self``, ``out=``, mutable arguments of custom ops)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return []
    written: list[torch.fx.Node] = []
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.kwargs.get(arg.name) if (arg.kwarg_only or i >= len(node.args)) else node.args[i]
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, torch.fx.Node):
                written.append(item)
    return written


class GraphFacts:
    """Positions, input/output storages and the writes into each storage of one graph."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.position: dict[torch.fx.Node, int] = {}
        self.writes: dict[int, list[int]] = defaultdict(list)
        self.unknown_writes = False
        self.placeholders: list[torch.fx.Node] = []
        self.input_storages: set[int] = set()
        self.output_storages: set[int] = set()
        self.storage: dict[torch.fx.Node, int | None] = {}
        for i, node in enumerate(graph.nodes):
            self.position[node] = i
            self.storage[node] = node_storage(node)
            if node.op == "placeholder":
                self.placeholders.append(node)
                key = node_storage(node)
                if key is not None:
                    self.input_storages.add(key)
            for dst in written_args(node):
                key = node_storage(dst)
                if key is None:
                    self.unknown_writes = True
                else:
                    self.writes[key].append(i)
        self.output_node: torch.fx.Node = next(iter(reversed(graph.nodes)))
        for out in self.outputs():
            key = node_storage(out)
            if key is not None:
                self.output_storages.add(key)

    def storage_of(self, node: object) -> int | None:
        return self.storage.get(node) if isinstance(node, torch.fx.Node) else None

    def replaced(self, node: torch.fx.Node, src: torch.fx.Node) -> None:
        """``node`` (a copy of ``src``) was replaced by ``src``: every view of ``node`` is now a
        view of ``src``, and if ``node``'s memory was returned, ``src``'s now is."""
        old, new = self.storage.get(node), self.storage.get(src)
        if old is None or old == new:
            return
        for n, key in self.storage.items():
            if key == old:
                self.storage[n] = new
        if old in self.output_storages and new is not None:
            self.output_storages.add(new)

    def outputs(self) -> list[torch.fx.Node]:
        if self.output_node.op != "output":
            return []
        flat: list[torch.fx.Node] = []

        def visit(a: object) -> None:
            if isinstance(a, torch.fx.Node):
                flat.append(a)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    visit(b)
            elif isinstance(a, dict):
                for b in a.values():
                    visit(b)

        visit(self.output_node.args)
        return flat

    def written_between(self, storage: int | None, after: int, upto: int) -> bool:
        """True when ``storage`` is written by a node at a position in ``(after, upto]`` (or
        unknown: a write into a tensor without meta could be anything)."""
        if storage is None:
            return True
        if self.unknown_writes:
            return True
        return any(after < p <= upto for p in self.writes.get(storage, ()))

    def is_written(self, storage: int | None) -> bool:
        return storage is None or self.unknown_writes or bool(self.writes.get(storage))

    def last_use(self, nodes: Iterable[torch.fx.Node]) -> int:
        return max((self.position[u] for n in nodes for u in n.users), default=-1)
