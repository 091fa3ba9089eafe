"""Which stream each node runs on, and whether two nodes on different streams are ordered.

A user stream is entered with ``npugraph_ex.scope_enter(["_user_stream_label", ...], [label,
...])`` and left with ``npugraph_ex.scope_exit()``; nodes outside any such scope run on the
default stream (label None). Two nodes on different streams are ordered only by an event: a
``npugraph_ex.record()`` on the first one's stream after it, and a ``npugraph_ex.wait([...])``
of that record on the second one's stream before the second node. Rewrites that make a write
happen earlier (re-inplacing) or share a buffer across streams ask :func:`ordered` first.
"""

from __future__ import annotations

import torch
import torch.fx

from npugraph_passes._compat import OpOverload

USER_STREAM_LABEL = "_user_stream_label"


def _marker(node: torch.fx.Node, name: str) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return False
    return bool(target.namespace == "npugraph_ex" and target._schema.name.split("::")[-1] == name)


def is_scope_enter(node: torch.fx.Node) -> bool:
    return _marker(node, "scope_enter")


def is_scope_exit(node: torch.fx.Node) -> bool:
    return _marker(node, "scope_exit")


def is_record(node: torch.fx.Node) -> bool:
    return _marker(node, "record")


def is_wait(node: torch.fx.Node) -> bool:
    return _marker(node, "wait")


class StreamMap:
    """Stream label of every node (None = the default stream) and the graph's event pairs."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.label: dict[torch.fx.Node, str | None] = {}
        self.position: dict[torch.fx.Node, int] = {}
        self.records: list[torch.fx.Node] = []
        self.waits: list[torch.fx.Node] = []
        stack: list[str | None] = []
        current: str | None = None
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
            if is_record(node):
                self.records.append(node)
            elif is_wait(node):
                self.waits.append(node)
        self.multi_stream = any(v is not None for v in self.label.values())

    def _event_between(self, first: torch.fx.Node, second: torch.fx.Node) -> bool:
        """A record on ``first``'s stream after it, waited on ``second``'s stream before it."""
        s1, s2 = self.label.get(first), self.label.get(second)
        p1, p2 = self.position[first], self.position[second]
        for wait in self.waits:
            pw = self.position[wait]
            if not (p1 < pw < p2) or self.label.get(wait) != s2:
                continue
            waited = wait.args[0] if wait.args else ()
            for rec in waited if isinstance(waited, (list, tuple)) else ():
                if (isinstance(rec, torch.fx.Node) and is_record(rec) and self.label.get(rec) == s1
                        and p1 < self.position[rec] < pw):
                    return True
        return False

    def ordered(self, a: torch.fx.Node, b: torch.fx.Node) -> bool:
        """True when ``a`` and ``b`` run in graph order: same stream, or an event between them."""
        if self.label.get(a) == self.label.get(b):
            return True
        first, second = (a, b) if self.position[a] < self.position[b] else (b, a)
        return self._event_between(first, second)

    def all_ordered(self, node: torch.fx.Node, others: list[torch.fx.Node]) -> bool:
        return all(self.ordered(node, o) for o in others)
