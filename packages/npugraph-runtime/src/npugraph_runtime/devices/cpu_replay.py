"""The replay function of a CPU graph: one generated straight-line Python function whose
tensors, callables and non-literal constants are bound as default arguments (fast locals), so a
replay is one call with no per-op loop, lookup or branch."""

from __future__ import annotations

import keyword
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from npugraph_runtime import _compat
from npugraph_runtime.devices.cpu_collectives import Emitter, work_path
from npugraph_runtime.devices.cpu_kernels import Kind, cheapest
from npugraph_runtime.devices.cpu_recorder import Step, TensorEntry, TRef


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


def _plan(
    steps: Sequence[Step], tensors: Sequence[TensorEntry], dead: set[int]
) -> list[tuple[Step, Kind, Any, tuple[str, ...], tuple[tuple[tuple[int, ...], TRef], ...]]]:
    """Walk the steps backwards: drop pure ops none of whose results is used (their storages are
    dead intermediates no later op reads), pick each remaining op's cheapest verified kernel given
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
            best = cheapest(step.candidates, step.copy_costs, needed)
            kind, call, out_names = best.kind, best.call, best.out_names
            if kind is Kind.COPY:
                outs = tuple(o for o, n in zip(outs, needed, strict=True) if n)
        for value in (*step.args, *step.kwargs.values()):
            read.update(tensors[r.i].storage for r in _refs(value))
        planned.append((step, kind, call, out_names, outs))
    planned.reverse()
    return planned


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
    for step, kind, call_obj, out_names, step_outs in _plan(steps, tensors, dead):
        issued += 1
        per_op.append((step, kind, len(lines)))
        args = [res.value(a) for a in step.args]
        kwargs = {k: res.value(v) for k, v in step.kwargs.items()}
        if kind is Kind.OUT_PUBLIC:
            outs = [res.tensor(r) for _, r in step_outs]
            out: object = outs[0] if len(outs) == 1 else tuple(outs)
            call = _call_args(names, args, {**kwargs, "out": out})
            lines.append(f"{names.bind(call_obj)}({call})")
        elif kind is Kind.OUT_OVERLOAD:
            outs = [res.tensor(r) for _, r in step_outs]
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
            entry = names.bind(call_obj if call_obj is not None else _compat.op_entry(step.func))
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
    body = "\n".join(f"        {line}" for line in lines) or "        pass"
    source = f"def replay({params}):\n    with inference_mode(True):\n{body}\n"
    namespace: dict[str, Any] = dict(names.values)
    exec(compile(source, "<npugraph cpu replay>", "exec"), namespace)
    fn: Callable[[], None] = namespace["replay"]
    fn.__source__ = source  # type: ignore[attr-defined]
    fn.__ops__ = (per_op, lines, namespace)  # type: ignore[attr-defined]
    return fn, issued
