"""Storage and mutation facts about FX nodes.

Every rewrite that changes which tensor a node reads or writes asks these questions first: which
memory does a node's value live in, which nodes write into it and where, and does it belong to a
graph input or a graph output.

Aliasing is read from the graph's structure, not from ``node.meta["val"]``: an op whose schema
says its result aliases an argument (views ``Tensor(a)``, in-place ops and ``out=`` returning
``Tensor(a!)``, ``getitem`` of a list of views) shares that argument's memory; every other ATen op
returns fresh memory. Meta values go stale when a pass replaces a node; the structure does not.
Nodes whose effect we cannot know (Python callables, higher-order ops) have unknown memory.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.fx

from npugraph_passes._compat import OpOverload, op_schema
from npugraph_passes.collectives import is_unannotated_collective


def _arg_value(node: torch.fx.Node, index: int, arg: object) -> object:
    name = getattr(arg, "name", "")
    if getattr(arg, "kwarg_only", False) or index >= len(node.args):
        return node.kwargs.get(name)
    return node.args[index]


# Views whose schema carries no alias annotation (AOT emits _unsafe_view after matmuls).
_UNANNOTATED_VIEWS = frozenset({torch.ops.aten._unsafe_view.default})


def alias_base(node: torch.fx.Node) -> torch.fx.Node | None:
    """The argument whose memory ``node``'s result shares, or None for fresh memory."""
    target = node.target
    if node.op != "call_function":
        return None
    if target in _UNANNOTATED_VIEWS:
        base = node.args[0] if node.args else None
        return base if isinstance(base, torch.fx.Node) else None
    if target is operator.getitem and node.args and isinstance(node.args[0], torch.fx.Node):
        parent = node.args[0]
        base = alias_base(parent)
        return base if base is not None and parent.target is not operator.getitem else None
    if not isinstance(target, OpOverload):
        return None
    schema = op_schema(target)
    if not schema.returns or schema.returns[0].alias_info is None:
        return None
    sets = schema.returns[0].alias_info.before_set
    if not sets:
        # a list of views (split, unbind, chunk: ``Tensor(a -> *) self -> Tensor(a)[]``): the
        # list's own annotation is empty, the argument says its memory goes into the list
        sets = {s for arg in schema.arguments if arg.alias_info is not None
                and "*" in arg.alias_info.after_set for s in arg.alias_info.before_set}
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.before_set & sets:
            value = _arg_value(node, i, arg)
            if isinstance(value, torch.fx.Node):
                return value
    return None


def _known(node: torch.fx.Node) -> bool:
    """Whether we know where ``node``'s result lives (ours or fresh)."""
    if node.op in ("placeholder", "get_attr"):
        return True
    if node.op != "call_function":
        return False
    return isinstance(node.target, OpOverload) or node.target is operator.getitem


def storage_root(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node that allocated the memory ``node``'s tensor lives in; None when unknown."""
    seen = 0
    while seen < 10_000:
        if not _known(node):
            return None
        base = alias_base(node)
        if base is None:
            return node
        node = base
        seen += 1
    return None  # pragma: no cover - a cycle cannot happen in a DAG


def node_storage(node: object) -> int | None:
    """An identity of the memory of a node's tensor value (the same for every view of it), or
    None when unknown or not a tensor."""
    if not isinstance(node, torch.fx.Node):
        return None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    root = storage_root(node)
    return id(root) if root is not None else None


def written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The argument nodes an op writes into (schema alias annotations with ``!``: in-place
    ``self``, ``out=``, mutable arguments of custom ops). The legacy ``c10d`` collectives write
    their tensors without saying so in their schemas: every tensor argument counts as written."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return []
    if is_unannotated_collective(node):
        return list(node.all_input_nodes)
    written: list[torch.fx.Node] = []
    for i, arg in enumerate(op_schema(target).arguments):
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
