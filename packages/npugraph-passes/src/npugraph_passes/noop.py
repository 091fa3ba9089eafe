"""remove_noop_ops: drops ops whose result equals their input.

The rules are inductor's (full slices, whole ``slice_scatter``, repeat by ones, zero pads,
same-dtype conversions, same-device puts, rounding of integers, ``pow(x, 1)``, single-input
``cat``, same-shape views, ``clone``, ``alias``, functional ``copy``) plus ours (same-shape
``expand``, identity ``permute``, ``transpose(d, d)``, same-dtype/device ``_to_copy``,
``mul``/``div`` by one, zero ``roll``, integer ``add``/``sub`` of zero). A node is only dropped when its value has the same
size, stride, dtype, device and layout as its source.

It never introduces aliasing between graph inputs and graph outputs (an output that would
become a placeholder or another output stays a copy), and it never removes a copy whose
source or result is written in place while the copy is still live (a user pass may have put
in-place ops in the graph).

Then it drops repeated ops (``repeated.remove_repeated_ops``): an op that computes exactly what
an earlier node computed reads that node instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from npugraph_passes import _compat
from npugraph_passes.aliasing import GraphFacts
from npugraph_passes.repeated import remove_repeated_ops

aten = torch.ops.aten

NoopRule = tuple[Callable[..., bool], Any]


def same_meta(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Same size, stride, dtype, device, layout and conj/neg bits (from ``meta["val"]``)."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
        return False
    return (
        _compat.statically_known_true(_compat.sym_eq(va.size(), vb.size()))
        and va.layout == vb.layout
        and va.dtype == vb.dtype
        and va.device == vb.device
        and (va.layout != torch.strided
             or _compat.statically_known_true(_compat.sym_eq(va.stride(), vb.stride())))
        and va.is_conj() == vb.is_conj()
        and va.is_neg() == vb.is_neg()
    )


def _expand_noop(x: torch.Tensor, size: Sequence[Any], implicit: bool = False) -> bool:
    return len(size) == x.dim() and all(
        s == -1 or _compat.statically_known_true(_compat.sym_eq(s, d)) for s, d in zip(size, x.shape, strict=True)
    )


def _permute_noop(x: torch.Tensor, dims: Sequence[int]) -> bool:
    return [d % max(x.dim(), 1) for d in dims] == list(range(x.dim()))


def _transpose_noop(x: torch.Tensor, d0: int, d1: int) -> bool:
    n = max(x.dim(), 1)
    return d0 % n == d1 % n


def _to_copy_noop(x: torch.Tensor, *, dtype: Any = None, layout: Any = None, device: Any = None,
                  pin_memory: Any = None, non_blocking: bool = False, memory_format: Any = None) -> bool:
    # Strides are compared by _same_meta; pinned memory is a different allocation kind.
    return (
        (dtype is None or dtype == x.dtype)
        and (layout is None or layout == x.layout)
        and (device is None or torch.device(device) == x.device)
        and not pin_memory
    )


def _scalar_one(x: torch.Tensor, other: object) -> bool:
    return isinstance(other, (int, float)) and not isinstance(other, bool) and other == 1


def _int_plus_zero(x: torch.Tensor, other: object, alpha: object = 1) -> bool:
    # exact for integers only: a float -0.0 + 0 is +0.0
    return (
        type(other) is int
        and other == 0
        and not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)
    )


def _roll_noop(x: torch.Tensor, shifts: Sequence[int], dims: Sequence[int] = ()) -> bool:
    return all(s == 0 for s in shifts)


_OWN_RULES: dict[Any, NoopRule] = {
    aten.expand.default: (_expand_noop, 0),
    aten.permute.default: (_permute_noop, 0),
    aten.transpose.int: (_transpose_noop, 0),
    aten._to_copy.default: (_to_copy_noop, 0),
    aten.mul.Scalar: (_scalar_one, 0),
    aten.div.Scalar: (_scalar_one, 0),
    aten.mul.Tensor: (_scalar_one, 0),
    aten.div.Tensor: (_scalar_one, 0),
    aten.roll.default: (_roll_noop, 0),
    aten.add.Tensor: (_int_plus_zero, 0),
    aten.add.Scalar: (_int_plus_zero, 0),
    aten.sub.Tensor: (_int_plus_zero, 0),
    aten.sub.Scalar: (_int_plus_zero, 0),
}

_NON_VIEW_COPIES = {aten.clone.default, aten._to_copy.default, aten.copy.default}


def noop_rules() -> dict[Any, NoopRule]:
    """Inductor's rules (where this torch has them) and ours; ours win for the same target."""
    rules = _compat.inductor_noop_registry()
    rules.update(_OWN_RULES)
    return rules


def _source(node: torch.fx.Node, src_index: Any) -> object:
    if isinstance(src_index, int):
        return node.args[src_index] if src_index < len(node.args) else None
    return src_index(node.args)


def remove_noop_ops(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
    """Replaces every no-op node by its source. Needs ``node.meta["val"]`` (any AOT or make_fx
    graph has it); nodes without it are left alone."""
    graph = gm.graph
    rules = noop_rules()
    facts = GraphFacts(graph)
    outputs = set(facts.outputs())
    placeholders = set(facts.placeholders)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in rules:
            continue
        cond, src_index = rules[node.target]
        src = _source(node, src_index)
        if not isinstance(src, torch.fx.Node):
            continue
        if node.target is aten.copy.default:
            dst = node.args[0]
            if isinstance(dst, torch.fx.Node) and dst.kwargs.get("pin_memory") is True:
                continue
        node_key, src_key = facts.storage_of(node), facts.storage_of(src)
        if node_key is None or src_key is None:
            continue
        is_view = node_key == src_key
        if not is_view:
            if node_key in facts.output_storages and (
                src_key in facts.input_storages or src_key in facts.output_storages
            ):
                continue
            # A copy protects its source from later writes and vice versa.
            last = max(facts.last_use([node]), facts.position[node])
            if facts.is_written(node_key) or facts.written_between(src_key, facts.position[node], last):
                continue
        elif node in outputs and (src in placeholders or src in outputs):
            continue
        ok, args, kwargs = _compat.fake_args_kwargs(node)
        if not ok or not same_meta(node, src):
            continue
        try:
            is_noop = cond(*args, **kwargs)
        except Exception:
            # A rule that cannot decide on these (symbolic) arguments keeps the node.
            continue
        if is_noop:
            if node in outputs:
                outputs.add(src)
                facts.output_storages.add(src_key)
            facts.replaced(node, src)
            node.replace_all_uses_with(src)
            graph.erase_node(node)
    remove_repeated_ops(gm, example_inputs, config)
