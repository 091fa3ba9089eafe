"""Collectives and their waits as ordering points of a graph.

A collective (``_c10d_functional.all_reduce``, ``all_gather_into_tensor``, ... and the in-place
``c10d`` / ``_c10d_functional.*_`` forms) is issued at its node and runs asynchronously until
its ``wait_tensor``: in between it may still read its inputs and write its result. The passes
therefore never rewrite a collective or a wait (a functional collective stays functional, so
the wait and every reader stay where AOT put them), and never make a node write into memory a
collective touches: its inputs, its result and what its wait returns
(:meth:`CollectiveMemory.touches`). That is stricter than "not while in flight", on purpose: it
holds whatever the device graph does with the wait (a CPU replay, NCCL or HCCL inside a graph),
and costs at most one buffer per collective.

Collectives are recognised by the op namespaces torch.distributed registers them under (torch
has no tag for them); a node of those namespaces whose name starts with ``wait`` is a wait.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx

from npugraph_passes import _compat

COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d", "c10d_functional"})


def _kind(node: torch.fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    qualified = _compat.op_namespace_and_name(node.target)
    if qualified is None or qualified[0] not in COLLECTIVE_NAMESPACES:
        return None
    return "wait" if qualified[1].startswith("wait") else "collective"


def is_collective(node: torch.fx.Node) -> bool:
    """A collective communication op (not its wait)."""
    return _kind(node) == "collective"


def is_collective_wait(node: torch.fx.Node) -> bool:
    return _kind(node) == "wait"


def is_unannotated_collective(node: torch.fx.Node) -> bool:
    """A legacy ``c10d`` op (``c10d.allreduce_``): it writes its tensor arguments although its
    schema carries no ``!`` annotation."""
    qualified = _compat.op_namespace_and_name(node.target) if node.op == "call_function" else None
    return qualified is not None and qualified[0] == "c10d"


def is_ordering_point(node: torch.fx.Node) -> bool:
    """A collective or a wait: never rewritten, never moved across."""
    return _kind(node) is not None


class CollectiveMemory:
    """The nodes whose memory a collective of the graph reads or writes: its tensor arguments,
    its result (and ``getitem`` of a list result), and the results of its waits. Memory is
    resolved at each question through ``storage_of``, so storages merged by rewrites after the
    analysis are seen."""

    def __init__(self, graph: torch.fx.Graph, storage_of: Callable[[torch.fx.Node], int | None]) -> None:
        self.storage_of = storage_of
        self.nodes: list[torch.fx.Node] = []
        for node in graph.nodes:
            if is_collective(node):
                self.nodes += [*node.all_input_nodes, node]
                self.nodes += [u for u in node.users if u.target is operator.getitem]
            elif is_collective_wait(node):
                self.nodes += [*node.all_input_nodes, node]

    def touches(self, storage: int | None) -> bool:
        """True when a collective may read or write ``storage`` (unknown memory: when the graph
        has any collective)."""
        if not self.nodes:
            return False
        keys = {self.storage_of(n) for n in self.nodes}
        return storage is None or storage in keys
