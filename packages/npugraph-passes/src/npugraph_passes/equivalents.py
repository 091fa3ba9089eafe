"""Cheaper forms of single ops that give bitwise the same result (run by pattern_fusion_pass).

* ``pow(x, 2)`` -> ``mul(x, x)``: ATen's CPU ``pow`` with the scalar exponent 2 computes
  ``x * x`` (inductor decomposes it the same way); ``mul`` gets there by a shorter path.
  The RMSNorm of Llama-like models squares its input once per norm.
* ``argmax(x, dim, keepdim)`` -> ``max(x, dim, keepdim).indices``: both return, for each row,
  the index of the first maximum, NaN counting as the maximum (its first index), and ``0.0`` and
  ``-0.0`` as equal; the CPU ``max.dim`` kernel is a plain scan, about three times faster than
  ``argmax``'s general reduction on a (8, 32000) logits row (greedy decoding).

Only for float32/float64 tensors on the CPU, whose kernels were checked; other devices and
dtypes keep their ops. A rewrite whose result would differ in dtype, shape or strides (by
``meta["val"]``) is undone.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from npugraph_passes import _compat

aten = torch.ops.aten

_DTYPES = (torch.float32, torch.float64)


def _cpu_float(node: object) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.dtype in _DTYPES


def _square(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node | None:
    x, exponent = (*node.args, None)[:2]
    if node.kwargs or type(exponent) not in (int, float) or exponent != 2 or not _cpu_float(x):
        return None
    return graph.call_function(aten.mul.Tensor, (x, x))


def _first_max_index(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node | None:
    x = node.args[0] if node.args else None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if type(dim) is not int or type(keepdim) is not bool or not _cpu_float(x):
        return None
    assert isinstance(x, torch.fx.Node)
    if x.meta["val"].dim() == 0:
        return None
    both = graph.call_function(aten.max.dim, (x, dim, keepdim))
    return graph.call_function(operator.getitem, (both, 1))


_RULES: dict[Any, Callable[[torch.fx.Graph, torch.fx.Node], torch.fx.Node | None]] = {
    aten.pow.Tensor_Scalar: _square,
    aten.argmax.default: _first_max_index,
}


def _fake_val(node: torch.fx.Node) -> Any:
    """The node's value computed from its arguments' ``meta["val"]``."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    mode = _compat.detect_fake_mode([args, kwargs])
    if mode is None:
        return node.target(*args, **kwargs)  # type: ignore[operator]
    with mode:
        return node.target(*args, **kwargs)  # type: ignore[operator]


def _same_layout(a: Any, b: Any) -> bool:
    return (
        isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        and (a.dtype, a.device, tuple(a.shape), a.stride()) == (b.dtype, b.device, tuple(b.shape), b.stride())
    )


def use_cheaper_equivalents(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
    """Rewrites every op that has a checked cheaper form; returns how many it rewrote."""
    graph = gm.graph
    rewritten = 0
    for node in list(graph.nodes):
        rule = _RULES.get(node.target) if node.op == "call_function" else None
        if rule is None or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        with graph.inserting_before(node):
            new = rule(graph, node)
        if new is None:
            continue
        made = [new]
        if new.target is operator.getitem and isinstance(new.args[0], torch.fx.Node):
            made.append(new.args[0])
        try:
            for n in reversed(made):
                n.meta["val"] = _fake_val(n)
            ok = _same_layout(new.meta["val"], node.meta["val"])
        except Exception:
            ok = False
        if not ok:
            for n in made:
                graph.erase_node(n)
            continue
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        rewritten += 1
    return rewritten
