"""The replay function of a CPU graph: one generated straight-line Python function whose
tensors, callables and non-literal constants are bound as default arguments (fast locals), so a
replay is one call with no per-op loop, lookup or branch.

Three forms give bitwise the same bytes by a shorter path than the recorded kernel: a ``cat`` of
same-dtype inputs is one ``copy_`` per input into its slice (a ``neg`` that only the cat reads
writes straight into its slice: RoPE's ``rotate_half``); an input-free ``arange`` or
``scalar_tensor`` copies the result saved at capture; an in-place unary op re-issued as it is
(``silu_``) calls its public binding."""

from __future__ import annotations

import keyword
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from npugraph_runtime import _compat
from npugraph_runtime.devices.base import scope_exits
from npugraph_runtime.devices.cpu_candidates import Kind, preferred, public_binding
from npugraph_runtime.devices.cpu_collectives import Emitter, work_path
from npugraph_runtime.devices.cpu_record import Step, TensorEntry, TRef
from npugraph_runtime.devices.cpu_streams import replays_marker
from npugraph_runtime.errors import CaptureError
from npugraph_runtime.spans import bytes_overlap


class _Names:
    """Local names for the objects the generated function uses, one per object."""

    def __init__(self) -> None:
        self.values: dict[str, object] = {}
        self._by_id: dict[int, str] = {}

    def bind(self, obj: object) -> str:
        name = self._by_id.get(id(obj))
        if name is None:
            name = f"v{len(self.values)}"
            self.values[name] = obj
            self._by_id[id(obj)] = name
        return name

    def expr(self, value: object) -> str:
        if value is None or type(value) in (bool, int, str):
            return repr(value)
        if type(value) is float and math.isfinite(value):
            return repr(value)
        return self.bind(value)


class _Resolver:
    """Recorded values back to objects: a ``TRef`` becomes the tensor the replay uses."""

    def __init__(self, tensors: Sequence[TensorEntry]) -> None:
        self._tensors = tensors
        self._views: dict[int, torch.Tensor] = {}

    def tensor(self, ref: TRef) -> torch.Tensor:
        entry = self._tensors[ref.i]
        obj = entry.obj
        assert obj is not None, "every recorded tensor is rebuilt before the replay is generated"
        if (
            tuple(obj.size()) == entry.size
            and tuple(obj.stride()) == entry.stride
            and obj.storage_offset() == entry.offset
        ):
            return obj
        # the tensor's metadata changed later in the capture (an in-place view op): replay the
        # ops recorded before that change on the view they saw
        view = self._views.get(ref.i)
        if view is None:
            view = torch.empty(0, dtype=entry.dtype).set_(
                obj.untyped_storage(), entry.offset, entry.size, entry.stride
            )
            self._views[ref.i] = view
        return view

    def value(self, value: Any) -> Any:
        if isinstance(value, TRef):
            return self.tensor(value)
        if isinstance(value, list):
            return [self.value(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.value(v) for v in value)
        return value


def _call_args(names: _Names, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    parts = [names.expr(a) for a in args]
    odd: dict[str, Any] = {}
    for k, v in kwargs.items():
        if k.isidentifier() and not keyword.iskeyword(k):
            parts.append(f"{k}={names.expr(v)}")
        else:
            odd[k] = v
    if odd:
        parts.append(f"**{names.bind(odd)}")
    return ", ".join(parts)


def _path(path: tuple[int, ...]) -> str:
    return "".join(f"[{i}]" for i in path)


def _refs(value: Any) -> Iterator[TRef]:
    if isinstance(value, TRef):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _refs(v)


_Planned = tuple[Step, Kind, Any, tuple[str, ...], tuple[tuple[tuple[int, ...], TRef], ...]]


def _plan(steps: Sequence[Step], tensors: Sequence[TensorEntry], dead: set[int]) -> list[_Planned]:
    """Walk the steps backwards: drop pure ops none of whose results is used (their storages are
    dead intermediates no later op reads), pick each remaining op's preferred verified kernel given
    which outputs are used, and copy only those. Returns (step, kind, call, out_names, outs)."""
    read: set[int] = set()
    planned = []
    for step in reversed(steps):
        kind = step.kind
        if kind is Kind.SKIP or (kind is Kind.FROZEN and not step.saved):
            continue
        outs = step.outs
        call, out_names = step.call, step.out_names
        if step.candidates:
            needed = [tensors[r.i].storage not in dead or tensors[r.i].storage in read for _, r in outs]
            if not any(needed):
                continue
            best = preferred(step.candidates)
            kind, call, out_names = best.kind, best.call, best.out_names
            if kind is Kind.COPY:
                outs = tuple(o for o, n in zip(outs, needed, strict=True) if n)
        for value in (*step.args, *step.kwargs.values()):
            read.update(tensors[r.i].storage for r in _refs(value))
        planned.append((step, kind, call, out_names, outs))
    planned.reverse()
    return planned


_CAT = torch.ops.aten.cat.default
# producers that may write their result straight into a slice of the cat that alone reads it:
# ops whose every element is exact whatever the output's strides (a sign flip), so the slice's
# strides cannot change a bit of it
_INTO_SLICE = frozenset({torch.ops.aten.neg.default})


def _cat_slices(step: Step, kind: Kind, res: _Resolver) -> list[tuple[Any, torch.Tensor]] | None:
    """A cat with an out= kernel as one ``copy_`` per input into its slice of the output (a cat
    of tensors of the output's dtype is a copy of their bytes, in less time than the cat kernel
    takes): (input ref or value, slice) per input, or None where it does not apply (other
    dtypes, zero-size or legacy 1-d empty inputs, an input overlapping the output)."""
    if step.func is not _CAT or kind not in (Kind.OUT_PUBLIC, Kind.OUT_OVERLOAD) or len(step.outs) != 1:
        return None
    args = list(step.args)
    if "tensors" in step.kwargs or len(args) > 2 or set(step.kwargs) - {"dim"}:
        return None
    dim = args[1] if len(args) > 1 else step.kwargs.get("dim", 0)
    inputs = args[0] if args else None
    out = res.tensor(step.outs[0][1])
    if type(dim) is not int or not isinstance(inputs, (list, tuple)) or out.dim() == 0:
        return None
    dim %= out.dim()
    slices: list[tuple[Any, torch.Tensor]] = []
    offset = 0
    for ref in inputs:
        t = res.value(ref)
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype != out.dtype
            or t.device != out.device
            or t.dim() != out.dim()
            or t.size(dim) == 0
            or any(t.size(d) != out.size(d) for d in range(out.dim()) if d != dim)
            or bytes_overlap(t, out)
        ):
            return None
        slices.append((ref, out.narrow(dim, offset, t.size(dim))))
        offset += t.size(dim)
    return slices if offset == out.size(dim) else None


def _split_cats(
    planned: Sequence[_Planned], tensors: Sequence[TensorEntry], dead: set[int], res: _Resolver
) -> tuple[dict[int, list[tuple[Any, torch.Tensor]]], dict[int, torch.Tensor]]:
    """Which cats become slice copies (by planned index), and which producers write straight
    into a cat's slice instead (by planned index: the slice): a producer in ``_INTO_SLICE``
    issued right before the cat, whose single result is a dead intermediate that no op but
    the cat reads, and whose inputs do not overlap the cat's output."""
    reads: dict[int, int] = {}
    for step, *_ in planned:
        for value in (*step.args, *step.kwargs.values()):
            for s in {tensors[r.i].storage for r in _refs(value)}:
                reads[s] = reads.get(s, 0) + 1
    cats: dict[int, list[tuple[Any, torch.Tensor]]] = {}
    into: dict[int, torch.Tensor] = {}
    for i, (step, kind, *_rest) in enumerate(planned):
        slices = _cat_slices(step, kind, res)
        if slices is None:
            continue
        cats[i] = slices
        if i == 0:
            continue
        prev, prev_kind, _call, _names, prev_outs = planned[i - 1]
        if prev.func not in _INTO_SLICE or prev_kind not in (Kind.OUT_PUBLIC, Kind.OUT_OVERLOAD):
            continue
        if len(prev_outs) != 1 or prev_outs[0][0] != ():
            continue
        made = prev_outs[0][1]
        storage = tensors[made.i].storage
        if storage not in dead or reads.get(storage) != 1:
            continue
        hits = [k for k, (ref, _) in enumerate(slices) if isinstance(ref, TRef) and ref.i == made.i]
        out = slices[0][1]
        sources = [res.value(a) for a in (*prev.args, *prev.kwargs.values())]
        if len(hits) != 1 or any(
            isinstance(t, torch.Tensor) and bytes_overlap(t, out) for t in sources
        ):
            continue
        into[i - 1] = slices[hits[0]][1]
        slices[hits[0]] = (None, slices[hits[0]][1])  # written there already
    return cats, into


_aten = torch.ops.aten
# factory ops that read no tensor and no mutable state: with the same constant arguments every
# replay computes the same bytes (random and empty factories are not here)
_INPUT_FREE = frozenset({
    _aten.arange.default, _aten.arange.start, _aten.arange.start_step, _aten.scalar_tensor.default,
})
_CONSTANT_MAX_NUMEL = 1 << 16  # a saved copy costs memory: only small results


def _constant_value(step: Step, kind: Kind, res: _Resolver) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(buffer, saved result) for an input-free factory op: the replay copies the result saved
    at capture into its buffer instead of recomputing it (an ``arange`` or ``scalar_tensor`` in
    a decode step is 25-30 µs with cold caches, the copy 1-2 µs). Only with every argument a
    constant; a floating result needs an explicit dtype (the default dtype may change)."""
    if step.func not in _INPUT_FREE or kind not in (Kind.COPY, Kind.OUT_PUBLIC, Kind.OUT_OVERLOAD):
        return None
    if len(step.outs) != 1 or step.outs[0][0] != ():
        return None
    if any(True for v in (*step.args, *step.kwargs.values()) for _ in _refs(v)):
        return None
    out = res.tensor(step.outs[0][1])
    if out.numel() > _CONSTANT_MAX_NUMEL or (out.is_floating_point() and "dtype" not in step.kwargs):
        return None
    with _compat.inference_mode_guard()(True):
        saved = _compat.op_entry(step.func)(*step.args, **step.kwargs)
    if not isinstance(saved, torch.Tensor) or (saved.dtype, saved.device, saved.shape) != (
        out.dtype, out.device, out.shape
    ):
        return None
    return out, saved


def _entry(step: Step, call_obj: Any) -> Any:
    """What a COPY, AS_IS or COLLECTIVE step calls. An in-place unary aten op re-issued as it is
    (``silu_``, which has no Tensor method) calls its public binding: the same op by Python's
    argument parser, about 0.3 µs shorter warm than the schema's stack (and more cold); its
    only signature is the schema's one tensor, so it cannot pick another overload."""
    if call_obj is not None:
        return call_obj
    func = step.func
    name = _compat.op_base_name(func)
    if (
        step.kind is Kind.AS_IS
        and func.namespace == "aten"
        and name.endswith("_")
        and len(_compat.op_schema(func).arguments) == 1
        and len(step.args) == 1
        and isinstance(step.args[0], TRef)
        and not step.kwargs
    ):
        binding = public_binding("aten", name)
        if binding is not None:
            return binding
    return _compat.op_entry(func)


def generate(
    steps: Sequence[Step], tensors: Sequence[TensorEntry], dead: set[int]
) -> tuple[Callable[[], None], int]:
    """The replay function of ``steps`` and the number of ops it issues. ``dead``: storages that
    nothing outside the graph holds (their values only matter to later ops of the graph)."""
    names = _Names()
    res = _Resolver(tensors)
    lines: list[str] = []
    collectives = Emitter(names, res, tensors)
    issued = 0
    per_op: list[tuple[Step, Kind, int]] = []  # (step, kernel, first line): for kernel audits
    planned = _plan(steps, tensors, dead)
    cats, into = _split_cats(planned, tensors, dead, res)
    for i, (step, kind, call_obj, out_names, step_outs) in enumerate(planned):
        issued += 1
        per_op.append((step, kind, len(lines)))
        args = [res.value(a) for a in step.args]
        kwargs = {k: res.value(v) for k, v in step.kwargs.items()}
        constant = _constant_value(step, kind, res)
        if constant is not None:
            lines.append(f"{names.bind(constant[0].copy_)}({names.bind(constant[1])})")
        elif i in cats:
            lines.extend(
                f"{names.bind(view.copy_)}({names.expr(res.value(ref))})"
                for ref, view in cats[i] if ref is not None
            )
        elif kind is Kind.OUT_PUBLIC:
            outs = [into[i]] if i in into else [res.tensor(r) for _, r in step_outs]
            out: object = outs[0] if len(outs) == 1 else tuple(outs)
            call = _call_args(names, args, {**kwargs, "out": out})
            lines.append(f"{names.bind(call_obj)}({call})")
        elif kind is Kind.OUT_OVERLOAD:
            outs = [into[i]] if i in into else [res.tensor(r) for _, r in step_outs]
            call = _call_args(names, args, {**kwargs, **dict(zip(out_names, outs, strict=True))})
            lines.append(f"{names.bind(call_obj)}({call})")
        elif kind is Kind.COPY_INTO:
            copy = names.bind(res.tensor(step_outs[0][1]).copy_)
            lines.append(f"{copy}({names.expr(call_obj(args))})")
        elif kind is Kind.INPLACE_METHOD:
            method = getattr(args[0], step.method)
            lines.append(f"{names.bind(method)}({_call_args(names, args[1:], kwargs)})")
        elif kind is Kind.COLLECTIVE_WAIT:
            lines.extend(collectives.wait(step.args))
        elif kind is Kind.FROZEN:
            for ref, saved in step.saved:
                lines.append(f"{names.bind(res.tensor(ref).copy_)}({names.bind(saved)})")
        else:  # COPY, AS_IS, COLLECTIVE: run the op, then copy its fresh results into place
            entry = names.bind(_entry(step, call_obj))
            call = f"{entry}({_call_args(names, args, kwargs)})"
            if kind is Kind.COLLECTIVE:
                lines.extend(collectives.collective(call, step_outs))
                continue
            work = work_path(step.func)
            if work is not None:
                lines.extend(collectives.issue_and_wait(call, work))
                lines.extend(f"{names.bind(res.tensor(ref).copy_)}(r{_path(p)})" for p, ref in step_outs)
                continue
            if not step_outs:
                lines.append(call)
                continue
            if len(step_outs) == 1 and step_outs[0][0] == ():
                copy = names.bind(res.tensor(step_outs[0][1]).copy_)
                lines.append(f"{copy}({call})")
                continue
            lines.append(f"r = {call}")
            for p, ref in step_outs:
                lines.append(f"{names.bind(res.tensor(ref).copy_)}(r{_path(p)})")

    lines.extend(collectives.finish())
    # inference mode: no autograd work, and the graph may write tensors captured in inference mode
    names.values["inference_mode"] = _compat.inference_mode_guard()
    params = ", ".join(f"{n}={n}" for n in names.values)
    if any(replays_marker(step.func) for step in steps):
        # a replay that raises inside a stream or core-limit scope exits the scopes it entered,
        # as eager code's with block would (else the thread stays on that stream, or limit)
        exits = scope_exits()
        if exits is None:
            raise CaptureError("internal: a scope marker was recorded, but no layer above the "
                               "devices provided scope exits (npugraph_runtime.ops)")
        names.values["scope_depth"], names.values["exit_scopes"] = exits
        params = ", ".join(f"{n}={n}" for n in names.values)
        body = "\n".join(f"            {line}" for line in lines) or "            pass"
        source = (f"def replay({params}):\n    depth = scope_depth()\n    try:\n"
                  f"        with inference_mode(True):\n{body}\n"
                  f"    except BaseException:\n        exit_scopes(depth)\n        raise\n")
    else:
        body = "\n".join(f"        {line}" for line in lines) or "        pass"
        source = f"def replay({params}):\n    with inference_mode(True):\n{body}\n"
    namespace: dict[str, Any] = dict(names.values)
    exec(compile(source, "<npugraph cpu replay>", "exec"), namespace)
    fn: Callable[[], None] = namespace["replay"]
    fn.__source__ = source  # type: ignore[attr-defined]
    fn.__ops__ = (per_op, lines, namespace)  # type: ignore[attr-defined]
    return fn, issued
