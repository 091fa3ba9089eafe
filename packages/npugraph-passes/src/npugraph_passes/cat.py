"""remove_cat_ops: a ``cat`` whose inputs can be written straight into its output.

``out = cat([f(a), g(b)], dim)`` allocates ``f(a)`` and ``g(b)`` and copies both into ``out``.
When every input is produced by an op with an ``out=`` variant and feeds only the cat, the
output is allocated first (``torch.empty``) and each producer writes its slice of it through
``out=``: no copy, no temporaries.

Applies when: at least two inputs, each a fresh result (no graph input, no view, no alias, used
once and only by this cat) of an op with an ``out=`` overload of the same arguments; the same
dtype and device as the output; equal sizes on every other dimension; static sizes along
``dim``; the slices along ``dim`` are contiguous blocks of the output (``dim`` 0, or every
dimension before it has size 1) and the output is contiguous; all of it on one stream; no input
is a collective or its wait (their results stay where torch.distributed puts them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from npugraph_passes.aliasing import alias_base, node_storage
from npugraph_passes.collectives import is_ordering_point
from npugraph_passes.out_variants import out_overload
from npugraph_passes.stream_safety import StreamMap

aten = torch.ops.aten


def _val(node: object) -> torch.Tensor | None:
    if isinstance(node, torch.fx.Node):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val
    return None


def _static(x: object) -> int | None:
    return x if isinstance(x, int) else None


def _cat_args(node: torch.fx.Node) -> tuple[list[object], int] | None:
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int):
        return None
    return list(tensors), dim


def _plan(node: torch.fx.Node, streams: StreamMap, storage_count: dict[int, int]) -> tuple[int, list[int]] | None:
    """The cat dimension and the static sizes of each input along it, or None if not applicable."""
    parsed = _cat_args(node)
    out = _val(node)
    if parsed is None or out is None:
        return None
    inputs, dim = parsed
    if len(inputs) < 2 or out.dim() == 0:
        return None
    dim %= out.dim()
    if not out.is_contiguous() or any(_static(s) != 1 for s in out.shape[:dim]):
        return None
    sizes: list[int] = []
    for inp in inputs:
        val = _val(inp)
        if not isinstance(inp, torch.fx.Node) or val is None or inp.op != "call_function" or is_ordering_point(inp):
            return None
        if out_overload(inp.target) is None or "out" in inp.kwargs or alias_base(inp) is not None:
            return None
        if set(inp.users) != {node} or inputs.count(inp) != 1:
            return None
        key = node_storage(inp)
        if key is None or storage_count.get(key, 0) != 1:  # shares memory with another node
            return None
        if val.dtype != out.dtype or val.device != out.device or val.dim() != out.dim():
            return None
        for d in range(out.dim()):
            if d != dim and _static(val.shape[d]) != _static(out.shape[d]):
                return None
            if _static(val.shape[d]) is None:
                return None
        sizes.append(int(val.shape[dim]))
        if streams.label.get(inp) != streams.label.get(node):
            return None
    if sum(sizes) != _static(out.shape[dim]):
        return None
    return dim, sizes


def remove_cat_ops(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
    """Replaces applicable ``aten.cat`` nodes by a preallocated buffer written through ``out=``.
    Needs ``node.meta["val"]``; nodes without it are left alone."""
    graph = gm.graph
    streams = StreamMap(graph)
    storage_count: dict[int, int] = {}
    for n in graph.nodes:
        key = node_storage(n)
        if key is not None:
            storage_count[key] = storage_count.get(key, 0) + 1
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.cat.default:
            continue
        plan = _plan(node, streams, storage_count)
        if plan is None:
            continue
        dim, sizes = plan
        inputs = [i for i in _cat_args(node)[0]]  # type: ignore[index]
        out = _val(node)
        assert out is not None
        first = min(inputs, key=lambda n: streams.position[n])  # type: ignore[arg-type,index]
        assert isinstance(first, torch.fx.Node)
        with graph.inserting_before(first):
            buf = graph.call_function(
                aten.empty.memory_format,
                (list(out.shape),),
                {"dtype": out.dtype, "device": out.device, "pin_memory": False},
            )
        buf.meta["val"] = torch.empty_like(out, memory_format=torch.contiguous_format)
        buf.meta["stack_trace"] = node.meta.get("stack_trace")
        offset = 0
        for inp, size in zip(inputs, sizes, strict=True):
            assert isinstance(inp, torch.fx.Node)
            with graph.inserting_before(inp):
                view = graph.call_function(aten.slice.Tensor, (buf, dim, offset, offset + size))
            view.meta["val"] = aten.slice.Tensor(buf.meta["val"], dim, offset, offset + size)
            view.meta["stack_trace"] = inp.meta.get("stack_trace")
            inp.target = out_overload(inp.target)
            inp.kwargs = {**inp.kwargs, "out": view}
            inp.meta["val"] = view.meta["val"]
            offset += size
        node.replace_all_uses_with(buf)
        graph.erase_node(node)
