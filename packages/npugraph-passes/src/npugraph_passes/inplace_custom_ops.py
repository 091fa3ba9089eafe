"""Custom ops with mutable arguments (``auto_functionalized``): which mutated tensors need no
clone, and the lowering every such node gets (see :mod:`npugraph_passes.reinplace`)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from npugraph_passes import _compat
from npugraph_passes.inplace_analysis import Analysis, meta_tensor
from npugraph_passes.overlap import may_self_overlap

__all__ = ["lower_auto_functionalized", "reinplace_auto_functionalized"]

aten = torch.ops.aten


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


def _hop_can_write(node: torch.fx.Node, base: torch.fx.Node, index: int, an: Analysis) -> torch.fx.Node | bool:
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
    val = meta_tensor(base)
    if val is None or may_self_overlap(val):
        return False
    if an.streams.multi_stream and not an.streams.all_ordered(
        node, an.users_of(base) + [u for n in news for u in n.users]
    ):
        return False
    return epilogue if epilogue is not None else True


def reinplace_auto_functionalized(gm: torch.fx.GraphModule, an: Analysis) -> None:
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
