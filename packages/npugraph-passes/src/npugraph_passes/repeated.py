"""Repeated ops: a node that computes exactly what an earlier node computed (same ATen op, the
same argument nodes, equal constants) reads the earlier node's result instead.

AOT graphs repeat work that eager code repeats: transformers' Llama turns its boolean attention
mask into a float mask with ``where(mask, scalar_tensor(0.0), scalar_tensor(-inf))`` once per
layer, so a 12-layer decode step builds the same mask twelve times. The rewrite is exact: the
earlier result is bitwise what the later op would compute.

A node is merged into an earlier one only when every one of these holds:

* both are deterministic ATen/prims ops with fresh results (no views, no ``out=``, nothing
  written, not seeded, not ``nondeterministic_bitwise``, not an allocation);
* the constants are equal in type and value (``0.0`` is not ``-0.0``, ``1`` is not ``1.0``);
* no argument's memory is written between the two, and neither result is ever written in place;
* neither is a graph output (two outputs must not become one tensor);
* no ordering point lies between them: any op outside aten/prims (stream switches, events,
  collectives, custom ops) starts afresh, so work is never moved across streams or a wait.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

from npugraph_passes._compat import OpOverload, op_schema
from npugraph_passes.aliasing import GraphFacts, written_args

_PURE_NAMESPACES = frozenset({"aten", "prims"})
_SKIPPED_TAGS = tuple(
    tag
    for tag in (getattr(torch.Tag, name, None) for name in ("nondeterministic_seeded", "nondeterministic_bitwise"))
    if tag is not None
)
_ALLOCATIONS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})
_PLAIN_CONSTANTS = (torch.dtype, torch.device, torch.layout, torch.memory_format, str, type(None))


class _Unkeyable(Exception):
    """A constant whose equality we do not trust (a symbolic value, an unknown object)."""


def _key(value: Any) -> Any:
    """A hashable key equal for two argument values exactly when the op sees the same thing."""
    if isinstance(value, torch.fx.Node):
        return ("node", value)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        # repr keeps the sign of zero; NaN never equals itself, so a NaN constant never merges
        return ("float", repr(value)) if not math.isnan(value) else ("nan", id(value))
    if isinstance(value, complex):
        return ("complex", repr(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, _PLAIN_CONSTANTS):
        return (type(value).__name__, value)
    raise _Unkeyable


def _nodes(value: Any) -> Iterator[torch.fx.Node]:
    if isinstance(value, torch.fx.Node):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _nodes(v)


def _mergeable(node: torch.fx.Node) -> bool:
    """A deterministic aten/prims op with fresh results that writes nothing."""
    target = node.target
    if not isinstance(target, OpOverload) or target.namespace not in _PURE_NAMESPACES:
        return False
    if any(tag in target.tags for tag in _SKIPPED_TAGS):
        return False
    if target.overloadpacket.__name__ in _ALLOCATIONS:
        return False
    schema = op_schema(target)
    if schema.is_mutable or written_args(node) or node.is_impure():
        return False
    if not schema.returns or any(r.alias_info is not None for r in schema.returns):
        return False
    return isinstance(node.meta.get("val"), torch.Tensor)


def _ordering_point(node: torch.fx.Node) -> bool:
    """Ops that may order the graph (streams, events, collectives, custom ops, higher-order ops)."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, OpOverload):
        return target.namespace not in _PURE_NAMESPACES
    return target is not operator.getitem and getattr(target, "__module__", "") not in ("_operator", "math")


def _same_meta(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = a.meta["val"], b.meta["val"]
    return (va.dtype, va.device, va.layout, tuple(va.shape), va.stride()) == (
        vb.dtype, vb.device, vb.layout, tuple(vb.shape), vb.stride()
    )


def remove_repeated_ops(gm: torch.fx.GraphModule, example_inputs: Any, config: Any) -> int:
    """Replaces every repeated op by the earlier node it repeats; returns how many it removed.
    Needs ``node.meta["val"]`` (nodes without it are left alone)."""
    graph = gm.graph
    facts = GraphFacts(graph)
    if facts.unknown_writes:
        return 0
    outputs = set(facts.outputs())
    seen: dict[Any, torch.fx.Node] = {}
    removed = 0
    for node in list(graph.nodes):
        if _ordering_point(node):
            seen.clear()
            continue
        if node.op != "call_function" or node in outputs or not _mergeable(node):
            continue
        storage = facts.storage_of(node)
        if facts.is_written(storage) or storage in facts.output_storages:
            continue
        try:
            key = (node.target, _key(node.args), _key(sorted(node.kwargs.items())))
        except (_Unkeyable, TypeError):
            continue
        earlier = seen.get(key)
        if earlier is None:
            seen[key] = node
            continue
        start, end = facts.position[earlier], facts.position[node]
        args_kept = all(
            not isinstance(a.meta.get("val"), torch.Tensor)
            or not facts.written_between(facts.storage_of(a), start, end)
            for a in _nodes((node.args, tuple(node.kwargs.values())))
        )
        if not args_kept or not _same_meta(earlier, node):
            seen[key] = node  # later repeats may still match this one
            continue
        facts.replaced(node, earlier)
        node.replace_all_uses_with(earlier)
        graph.erase_node(node)
        removed += 1
    return removed
