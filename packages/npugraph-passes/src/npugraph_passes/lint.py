"""Capture-safety lint: names every node that cannot be captured into a device graph.

A device graph records device work only. Anything that needs the host during the step (reading a
value back, a shape that depends on data, drawing random numbers from the host generator, a
tensor computed on the CPU inside a CUDA/NPU graph) would be baked in at capture and be wrong on
replay, or fails the capture. The lint does not change the graph: it stores its findings in
``gm.meta["npugraph_ex_unsafe_nodes"]`` and the backend turns them into an error or into eager
execution with one warning.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from npugraph_passes._compat import HigherOrderOperator, OpOverload, op_schema

META_KEY = "npugraph_ex_unsafe_nodes"

_HOST_SYNC = "host sync (reads a tensor value back to the host)"
_DATA_SHAPE = "data-dependent output shape"
_RNG = "random number generation (the host generator state is baked in at capture)"
_CPU = "CPU tensor inside a {device} graph"
_CONTROL_FLOW = ("data-dependent control flow (a tensor decides which ops run: a replay would "
                 "repeat the captured branch or trip count)")

_SCALAR_RETURNS = frozenset({"number", "bool", "int", "float", "Scalar", "complex"})
_METADATA_OPS = frozenset({"dim", "size", "stride", "numel", "is_contiguous", "storage_offset",
                           "is_same_size", "is_floating_point", "is_complex", "_nested_tensor_size"})


@dataclass(frozen=True)
class UnsafeNode:
    """One node that cannot be captured; ``source`` is the user's line (``file:line: code``)."""

    name: str
    target: str
    reason: str
    source: str | None

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source else ""
        return f"{self.name} ({self.target}): {self.reason}{where}"


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def user_source_line(node: torch.fx.Node) -> str | None:
    """The innermost frame of ``node.meta["stack_trace"]`` as ``file:line in fn: code``."""
    trace = node.meta.get("stack_trace")
    if not isinstance(trace, str) or not trace.strip():
        return None
    lines = trace.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        match = _FRAME.search(lines[i])
        if match:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            text = f"{match.group(1)}:{match.group(2)} in {match.group(3)}"
            return f"{text}: {code}" if code else text
    return lines[-1].strip()


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _graph_device(graph: torch.fx.Graph) -> torch.device | None:
    """The accelerator the graph computes on, or None for a CPU (or device-less) graph."""
    for node in graph.nodes:
        for t in _tensors(node.meta.get("val")):
            if t.device.type not in ("cpu", "meta"):
                return t.device
    return None


def _is_bool_index(node: torch.fx.Node) -> bool:
    indices = node.args[1] if len(node.args) > 1 else node.kwargs.get("indices", ())
    for idx in indices if isinstance(indices, (list, tuple)) else ():
        if isinstance(idx, torch.fx.Node):
            val = idx.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dtype in (torch.bool, torch.uint8):
                return True
    return False


def _arg(node: torch.fx.Node, target: Any, name: str) -> tuple[bool, object]:
    for i, arg in enumerate(op_schema(target).arguments):
        if arg.name != name:
            continue
        if name in node.kwargs:
            return True, node.kwargs[name]
        if i < len(node.args) and not arg.kwarg_only:
            return True, node.args[i]
        return True, arg.default_value if arg.has_default_value() else None
    return False, None


def _draws_random(node: torch.fx.Node, target: Any) -> bool:
    """Seeded ops draw random numbers unless their dropout is off (attention kernels and
    dropout in eval mode carry the tag but take ``dropout_p=0`` / ``train=False``)."""
    has_train, train = _arg(node, target, "train")
    if has_train and train is False:
        return False
    has_p, p = _arg(node, target, "dropout_p")
    return not (has_p and isinstance(p, (int, float)) and p == 0)


def _control_flow_reason(node: torch.fx.Node, target: Any) -> str | None:
    """``while_loop`` always tests a tensor; ``cond`` does unless its predicate is a Python or
    symbolic bool (a shape test, fixed for each graph key)."""
    name = target.name()
    if name == "while_loop":
        return _CONTROL_FLOW
    if name == "cond" and node.args:
        pred = node.args[0]
        if isinstance(pred, torch.fx.Node) and isinstance(pred.meta.get("val"), torch.Tensor):
            return _CONTROL_FLOW
    return None


def _op_reason(node: torch.fx.Node) -> str | None:
    target = node.target
    if isinstance(target, HigherOrderOperator):
        return _control_flow_reason(node, target)
    if not isinstance(target, OpOverload):
        if target in (torch.Tensor.item, torch.Tensor.tolist):
            return _HOST_SYNC
        return None
    tags = set(target.tags)
    if torch.Tag.nondeterministic_seeded in tags and _draws_random(node, target):
        return _RNG
    if torch.Tag.data_dependent_output in tags:
        return _HOST_SYNC
    if torch.Tag.dynamic_output_shape in tags:
        if target is torch.ops.aten.index.Tensor and not _is_bool_index(node):
            return None
        return _DATA_SHAPE
    schema = op_schema(target)
    base = schema.name.split("::")[-1]
    returns = [str(r.type) for r in schema.returns]
    takes_tensor = any(isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
                       for a in node.all_input_nodes)
    if (takes_tensor and returns and all(r in _SCALAR_RETURNS for r in returns)
            and not base.startswith("sym_") and base not in _METADATA_OPS):
        return _HOST_SYNC
    return None


def _on_cpu(value: object) -> bool:
    return any(t.device.type == "cpu" for t in _tensors(value))


def _on_device(value: object) -> bool:
    return any(t.device.type not in ("cpu", "meta") for t in _tensors(value))


def _is_marker(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, OpOverload) and target.namespace == "npugraph_ex"


def _device_reason(node: torch.fx.Node, device: torch.device, host_varying: set[torch.fx.Node]) -> str | None:
    """A CPU tensor in a device graph is unsafe when it is copied from the device (a sync) or
    when its value changes from call to call (it would be read once, at capture). CPU constants
    (``torch.tensor(2.0)`` in the model) are read at capture and never change: they are fine."""
    if _is_marker(node):
        return None
    inputs = node.all_input_nodes
    if node.op == "placeholder":
        if _on_cpu(node.meta.get("val")) and any(not _is_marker(u) for u in node.users):
            host_varying.add(node)
            return _CPU.format(device=device.type)
        return None
    if not _on_cpu(node.meta.get("val")):
        return None
    if any(_on_device(a.meta.get("val")) for a in inputs):
        return _HOST_SYNC
    if any(a in host_varying for a in inputs):
        host_varying.add(node)
        return _CPU.format(device=device.type)
    return None


def find_unsafe_nodes(gm: torch.fx.GraphModule) -> list[UnsafeNode]:
    """Every node of ``gm`` that cannot be captured, in graph order. Needs ``node.meta["val"]``
    for the device checks; op-level checks (host sync, data-dependent shape, RNG) need none."""
    device = _graph_device(gm.graph)
    host_varying: set[torch.fx.Node] = set()
    found: list[UnsafeNode] = []
    for name, sub in gm.named_children():
        # the bodies of higher-order operators (invoke_subgraph, scan, ...): their ops run in
        # the same capture
        if isinstance(sub, torch.fx.GraphModule):
            found += [dataclasses.replace(u, name=f"{name}.{u.name}")
                      for u in find_unsafe_nodes(sub)]
    for node in gm.graph.nodes:
        reason: str | None = None
        if node.op == "call_function":
            reason = _op_reason(node)
        if reason is None and device is not None and node.op in ("call_function", "placeholder"):
            reason = _device_reason(node, device, host_varying)
        if reason is not None:
            found.append(UnsafeNode(node.name, str(node.target), reason, user_source_line(node)))
    return found


def capture_safety_lint(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
    """Stores :func:`find_unsafe_nodes` in ``gm.meta["npugraph_ex_unsafe_nodes"]``; never edits."""
    gm.meta[META_KEY] = find_unsafe_nodes(gm)
