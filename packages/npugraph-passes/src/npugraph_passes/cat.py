"""remove_cat_ops: a ``cat`` whose inputs can be written straight into its output.

``out = cat([f(a), g(b)], dim)`` allocates ``f(a)`` and ``g(b)`` and copies both into ``out``.
When every input is produced by an op with an ``out=`` variant and feeds only the cat, the
output is allocated first (``torch.empty``) and each producer writes its slice of it through
``out=``: no copy, no temporaries.

Applies when: at least two inputs, each a fresh result (no graph input, no view, no alias, used
once and only by this cat, ``npugraph_ex.wait`` markers aside) of an op with an ``out=`` overload of the same arguments; the same
dtype and device as the output; equal sizes on every other dimension; static sizes along
``dim``; the slices along ``dim`` are contiguous blocks of the output (``dim`` 0, or every
dimension before it has size 1) and the output is contiguous; no input is a collective or its
wait (their results stay where torch.distributed puts them).

Inputs made on other streams than the cat's (two branches on two streams joined by events) are
written into their slices on their own streams, where they ran. The cat must already wait for
each of them (else the graph races and is left alone); the buffer is allocated on the cat's
stream before the first input. A buffer is one allocation to the streams: each write into it
comes after the previous access on another stream (the allocation, then each earlier write), by
an event where the graph does not order them already.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from npugraph_passes.aliasing import alias_base, node_storage
from npugraph_passes.collectives import is_ordering_point
from npugraph_passes.out_variants import out_overload
from npugraph_passes.stream_safety import StreamMap, is_scope_enter, is_wait
from npugraph_passes.stream_scopes import order_streams

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
        # a wait naming the tensor only keeps its memory until the streams join: no read
        if {u for u in inp.users if not is_wait(u)} != {node} or inputs.count(inp) != 1:
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
        if not streams.ordered(inp, node):
            return None
    if sum(sizes) != _static(out.shape[dim]):
        return None
    return dim, sizes


def _allocation_point(node: torch.fx.Node, first: torch.fx.Node, streams: StreamMap) -> torch.fx.Node | None:
    """The last node before ``first`` that runs on ``node``'s stream: the buffer is allocated
    right after it, on the stream that reads it as the cat's result."""
    label = streams.label.get(node)
    anchor: torch.fx.Node | None = None
    for n in node.graph.nodes:
        if n is first:
            break
        if streams.label.get(n) == label and not is_scope_enter(n):
            anchor = n
    return anchor


def _label(node: torch.fx.Node, like: torch.fx.Node) -> None:
    """``node`` runs on ``like``'s stream (the label lowering left, where it ran already)."""
    if "stream_label" in like.meta:
        node.meta["stream_label"] = like.meta["stream_label"]


def remove_cat_ops(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
    """Replaces applicable ``aten.cat`` nodes by a preallocated buffer written through ``out=``.
    Needs ``node.meta["val"]``; nodes without it are left alone."""
    graph = gm.graph
    storage_count: dict[int, int] = {}
    for n in graph.nodes:
        key = node_storage(n)
        if key is not None:
            storage_count[key] = storage_count.get(key, 0) + 1
    streams = StreamMap(graph)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.cat.default:
            continue
        if node not in streams.label:  # an earlier rewrite added nodes (and events)
            streams = StreamMap(graph)
        plan = _plan(node, streams, storage_count)
        if plan is None:
            continue
        dim, sizes = plan
        inputs = [i for i in _cat_args(node)[0]]  # type: ignore[index]
        out = _val(node)
        assert out is not None
        first = min(inputs, key=lambda n: streams.position[n])  # type: ignore[arg-type,index]
        assert isinstance(first, torch.fx.Node)
        point = _allocation_point(node, first, streams)
        if point is None:
            continue
        with graph.inserting_after(point):
            buf = graph.call_function(
                aten.empty.memory_format,
                (list(out.shape),),
                {"dtype": out.dtype, "device": out.device, "pin_memory": False},
            )
        buf.meta["val"] = torch.empty_like(out, memory_format=torch.contiguous_format)
        buf.meta["stack_trace"] = node.meta.get("stack_trace")
        _label(buf, point)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        # (the last access to the buffer as the stream map knows it, the node it is in the graph)
        last: tuple[torch.fx.Node, torch.fx.Node] = (point, buf)
        for inp, offset, size in sorted(zip(inputs, offsets, sizes, strict=True),
                                        key=lambda t: streams.position[t[0]]):  # type: ignore[index]
            assert isinstance(inp, torch.fx.Node)
            with graph.inserting_before(inp):
                view = graph.call_function(aten.slice.Tensor, (buf, dim, offset, offset + size))
            view.meta["val"] = aten.slice.Tensor(buf.meta["val"], dim, offset, offset + size)
            view.meta["stack_trace"] = inp.meta.get("stack_trace")
            _label(view, inp)
            if not streams.ordered(last[0], inp):
                order_streams(gm, last[1], view)
            last = (inp, inp)
            inp.target = out_overload(inp.target)
            inp.kwargs = {**inp.kwargs, "out": view}
            inp.meta["val"] = view.meta["val"]
        node.replace_all_uses_with(buf)
        graph.erase_node(node)
        streams.label.clear()
