"""The replay function of a CPU graph: one generated straight-line Python function whose
tensors, callables and non-literal constants are bound as default arguments (fast locals), so a
replay is one call with no per-op loop, lookup or branch."""

from __future__ import annotations

import keyword
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from npugraph_runtime import _compat
from npugraph_runtime.devices.cpu_kernels import Kind
from npugraph_runtime.devices.cpu_recorder import Step, TensorEntry, TRef

_WAIT = "_c10d_functional::wait_tensor"


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


def generate(steps: Sequence[Step], tensors: Sequence[TensorEntry]) -> tuple[Callable[[], None], int]:
    """The replay function of ``steps`` and the number of ops it issues."""
    names = _Names()
    res = _Resolver(tensors)
    lines: list[str] = []
    issued = 0
    for step in steps:
        kind = step.kind
        if kind is Kind.SKIP:
            continue
        issued += 1
        args = [res.value(a) for a in step.args]
        kwargs = {k: res.value(v) for k, v in step.kwargs.items()}
        if kind is Kind.OUT_PUBLIC:
            outs = [res.tensor(r) for _, r in step.outs]
            out: object = outs[0] if len(outs) == 1 else tuple(outs)
            call = _call_args(names, args, {**kwargs, "out": out})
            lines.append(f"{names.bind(step.call)}({call})")
        elif kind is Kind.OUT_OVERLOAD:
            outs = [res.tensor(r) for _, r in step.outs]
            call = _call_args(names, args, {**kwargs, **dict(zip(step.out_names, outs, strict=True))})
            lines.append(f"{names.bind(step.call)}({call})")
        elif kind is Kind.INPLACE_METHOD:
            method = getattr(args[0], step.method)
            lines.append(f"{names.bind(method)}({_call_args(names, args[1:], kwargs)})")
        elif kind is Kind.FROZEN:
            for ref, saved in step.saved:
                lines.append(f"{names.bind(res.tensor(ref).copy_)}({names.bind(saved)})")
        else:  # COPY, AS_IS, COLLECTIVE: run the op, then copy its fresh results into place
            entry = names.bind(_compat.op_entry(step.func))
            call = f"{entry}({_call_args(names, args, kwargs)})"
            if not step.outs:
                lines.append(call)
                continue
            if len(step.outs) == 1 and step.outs[0][0] == () and kind is not Kind.COLLECTIVE:
                copy = names.bind(res.tensor(step.outs[0][1]).copy_)
                lines.append(f"{copy}({call})")
                continue
            lines.append(f"r = {call}")
            if kind is Kind.COLLECTIVE:
                wait = names.bind(_compat.op_entry(torch.ops._c10d_functional.wait_tensor.default))
                lines.extend(f"{wait}(r{_path(p)})" for p, _ in step.outs)
            for p, ref in step.outs:
                lines.append(f"{names.bind(res.tensor(ref).copy_)}(r{_path(p)})")

    names.values["is_grad_enabled"] = torch.is_grad_enabled
    names.values["set_grad_enabled"] = _compat.set_grad_enabled_fn()
    params = ", ".join(f"{n}={n}" for n in names.values)
    body = "\n".join(f"        {line}" for line in lines) or "        pass"
    source = (
        f"def replay({params}):\n"
        "    grad = is_grad_enabled()\n"
        "    set_grad_enabled(False)\n"
        "    try:\n"
        f"{body}\n"
        "    finally:\n"
        "        set_grad_enabled(grad)\n"
    )
    namespace: dict[str, Any] = dict(names.values)
    exec(compile(source, "<npugraph cpu replay>", "exec"), namespace)
    fn: Callable[[], None] = namespace["replay"]
    fn.__source__ = source  # type: ignore[attr-defined]
    return fn, issued
