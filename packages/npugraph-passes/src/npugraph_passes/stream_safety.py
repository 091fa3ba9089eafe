"""Which stream each node runs on, and whether two nodes on different streams are ordered.

A user stream is entered with ``npugraph_ex.scope_enter(["_user_stream_label", ...], [label,
...])`` and left with ``npugraph_ex.scope_exit()``; nodes outside any such scope run on the
default stream (label None). On one stream nodes run in graph order. Across streams the only
order is made by ``npugraph_ex.wait([x, ...])``: the nodes after the wait, on the waiting
stream, run after ``x`` (usually a ``npugraph_ex.record()``) and everything before ``x`` on its
stream — transitively, through any chain of waits. Each node carries a vector clock (per stream,
the last position known to have run before it); ``a`` runs before ``b`` when ``b``'s clock for
``a``'s stream reaches ``a``. Rewrites that make a write happen earlier (re-inplacing) or
share a buffer across streams ask :meth:`StreamMap.ordered` first.
"""

from __future__ import annotations

import torch
import torch.fx

from npugraph_passes._compat import OpOverload, op_schema

USER_STREAM_LABEL = "_user_stream_label"


def _marker(node: torch.fx.Node, name: str) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return False
    return bool(target.namespace == "npugraph_ex" and op_schema(target).name.split("::")[-1] == name)


def is_scope_enter(node: torch.fx.Node) -> bool:
    return _marker(node, "scope_enter")


def is_scope_exit(node: torch.fx.Node) -> bool:
    return _marker(node, "scope_exit")


def is_record(node: torch.fx.Node) -> bool:
    return _marker(node, "record")


def is_wait(node: torch.fx.Node) -> bool:
    return _marker(node, "wait")


class StreamMap:
    """Stream label of every node (None = the default stream) and the happens-before order."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.label: dict[torch.fx.Node, str | None] = {}
        self.position: dict[torch.fx.Node, int] = {}
        self.clock: dict[torch.fx.Node, dict[str | None, int]] = {}
        stack: list[str | None] = []
        current: str | None = None
        running: dict[str | None, dict[str | None, int]] = {}
        for i, node in enumerate(graph.nodes):
            self.position[node] = i
            if is_scope_enter(node):
                keys = list(node.args[0] if node.args else node.kwargs.get("keys", ()))
                values = list(node.args[1] if len(node.args) > 1 else node.kwargs.get("values", ()))
                stack.append(current)
                if USER_STREAM_LABEL in keys:
                    current = str(values[keys.index(USER_STREAM_LABEL)])
            elif is_scope_exit(node):
                current = stack.pop() if stack else None
            self.label[node] = current
            clock = running.setdefault(current, {})
            if is_wait(node):
                waited = node.args[0] if node.args else node.kwargs.get("nodes", ())
                for w in waited if isinstance(waited, (list, tuple)) else ():
                    for stream, pos in self.clock.get(w, {}).items() if isinstance(w, torch.fx.Node) else ():
                        if clock.get(stream, -1) < pos:
                            clock[stream] = pos
            clock[current] = i
            self.clock[node] = dict(clock)
        self.multi_stream = any(v is not None for v in self.label.values())

    def ordered(self, a: torch.fx.Node, b: torch.fx.Node) -> bool:
        """True when ``a`` and ``b`` cannot run at the same time: same stream, or the later one
        waits (through events, transitively) for the earlier one."""
        if a not in self.position or b not in self.position:
            return not self.multi_stream  # made after the analysis: its stream is not known
        if self.label[a] == self.label[b]:
            return True
        first, second = (a, b) if self.position[a] < self.position[b] else (b, a)
        return self.clock[second].get(self.label.get(first), -1) >= self.position[first]

    def all_ordered(self, node: torch.fx.Node, others: list[torch.fx.Node]) -> bool:
        return all(self.ordered(node, o) for o in others)
