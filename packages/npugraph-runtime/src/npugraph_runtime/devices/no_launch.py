"""Collectives that a run records or repeats without launching them.

An accelerator's capture launches nothing, so a call whose capture is not its own run (a warm-up
was the run, or the replay that follows is) issues each collective once. The CPU graph computes
while it records: where its run is not the call's, each collective is recorded but stands in for
itself locally (``stand_in``), and so are the collectives of the warm-up runs that are undone
(``NoLaunch``, any device). Otherwise a rank issues them twice in one call: when only that rank
captures (another key, outputs held), the ranks go out of step.

A stand-in leaves the tensors a collective writes in place as they are, returns a completed Work
for a ``c10d::*`` op, and gives a functional collective's result the layout the real one has,
holding the input where the shapes agree (an all_reduce) and zeros otherwise. The values after a
collective are then this rank's alone: only the run's ops matter (a capture refuses reading
values on the host), and its writes are undone."""

from __future__ import annotations

from typing import Any

import torch

from npugraph_runtime import _compat
from npugraph_runtime._compat import TorchDispatchMode
from npugraph_runtime.errors import CaptureError
from npugraph_runtime.schema import write_positions

_NAMESPACES = frozenset({"c10d", "_c10d_functional"})
# the ops of those namespaces that talk to no other rank (checked on torch 2.13.0)
_LOCAL = frozenset({"wait_tensor", "_wrap_tensor_autograd", "check_for_nan"})

__all__ = ["Launched", "NoLaunch", "UndoneRun", "launched", "launches", "relaunched", "stand_in"]


def launches(func: Any) -> bool:
    """``func`` communicates with other ranks (a wait does not: it waits on this rank's work)."""
    return func.namespace in _NAMESPACES and _compat.op_base_name(func) not in _LOCAL


def stand_in(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What ``func`` returns, without launching it (see the module docstring)."""
    schema = _compat.op_schema(func)
    values = _bound(schema, args, kwargs)
    fresh: Any = None
    out: list[Any] = []
    for i, ret in enumerate(schema.returns):
        kind = str(ret.type)
        alias = ret.alias_info
        if "Work" in kind:
            out.append(_compat.completed_work())
        elif alias is not None and (same := _aliased(schema, values, alias)) is not _NONE:
            out.append(same)
        elif func.namespace == "c10d" and (same := _typed(schema, values, kind)) is not _NONE:
            out.append(same)  # c10d ops return their output arguments, unannotated
        else:
            if fresh is None:
                fresh = _compat.fake_results(func, args, kwargs)
                fresh = [fresh] if len(schema.returns) == 1 else list(fresh)
            out.append(_local(fresh[i], _tensors(values)))
    return out[0] if len(out) == 1 else tuple(out)


class Launched:
    """What one launched collective left: its op and a copy of every tensor it wrote or returned,
    taken once it completed. A CPU capture made again (mirrored, see capture.record) hands them
    to the collectives its new run issues in the same order, so that a rank issues each of them
    once in the call: the new run computes the same values (the same fn on the same inputs)."""

    __slots__ = ("func", "values")

    def __init__(self, func: Any, values: list[torch.Tensor]) -> None:
        self.func = func
        self.values = values


def launched(func: Any, result: Any, written: list[torch.Tensor]) -> Launched:
    """``func`` was launched and returned ``result``: wait for it (in this run only: its caller's
    own wait then finds it done) and keep what it left."""
    for v in _leaves(result):
        if isinstance(v, torch.ScriptObject):
            _compat.wait_work(v)
    targets = [t for t in _leaves(result) if isinstance(t, torch.Tensor)] + written
    if func.namespace == "_c10d_functional":
        wait = _compat.wait_tensor_overload()
        for t in targets:
            wait(t)
    return Launched(func, [t.clone() for t in targets])


def relaunched(entry: Launched, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               written: list[torch.Tensor]) -> Any:
    """What ``func`` returns, made of what its earlier launch ``entry`` left, without launching."""
    if entry.func is not func:
        raise CaptureError(
            f"a capture made again (to mirror an input read through as_strided) issued {func} "
            f"where its first run issued {entry.func}: fn must issue the same collectives on the "
            "same inputs every time it runs")
    result = stand_in(func, args, kwargs)
    targets = [t for t in _leaves(result) if isinstance(t, torch.Tensor)] + written
    for t, v in zip(targets, entry.values, strict=True):
        t.copy_(v)
    return result


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


_NONE: Any = object()


def _bound(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    values = []
    for i, arg in enumerate(schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            values.append(args[i])
        elif arg.name in kwargs:
            values.append(kwargs[arg.name])
        else:
            values.append(arg.default_value if arg.has_default_value() else None)
    return values


def _aliased(schema: Any, values: list[Any], alias: Any) -> Any:
    sets = set(alias.before_set)
    for arg, value in zip(schema.arguments, values, strict=True):
        if arg.alias_info is not None and sets & set(arg.alias_info.before_set):
            return value
    return _NONE


def _typed(schema: Any, values: list[Any], kind: str) -> Any:
    for arg, value in zip(schema.arguments, values, strict=True):
        if str(arg.type) == kind:
            return value
    return _NONE


def _tensors(values: list[Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, list | tuple):
            found += _tensors(list(v))
    return found


def _local(fake: Any, inputs: list[torch.Tensor]) -> Any:
    if isinstance(fake, list | tuple):
        return [_local(f, inputs) for f in fake]
    t = torch.empty_strided(fake.size(), fake.stride(), dtype=fake.dtype, device=fake.device)
    same = next((x for x in inputs if x.size() == t.size() and x.dtype == t.dtype), None)
    return t.copy_(same) if same is not None else t.zero_()


class NoLaunch(TorchDispatchMode):  # type: ignore[misc,no-untyped-call]
    """Runs what it wraps eagerly with every collective standing in for itself."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if launches(func):
            return stand_in(func, args, kwargs)
        return func(*args, **kwargs)


def _plain(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` with each functional collective's lazy result waited on (its own wait is unseen by
    a mode) and replaced by the plain tensor it wraps."""
    resolved = _compat.resolve_async_collectives(args, kwargs, lambda t: t.trigger_wait())
    return (args, kwargs) if resolved is None else resolved


def _ptr(t: torch.Tensor) -> int:
    """``t``'s storage address; 0 for a tensor without one of its own (a wrapper subclass)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except RuntimeError:
        return 0


# namespaces whose schemas declare every argument they write; another op may write any input
_TRUSTED = frozenset({"aten", "prims", "_c10d_functional", "npugraph_ex"})


class UndoneRun(NoLaunch):
    """NoLaunch that also keeps what the run overwrites in every tensor that existed before it
    (fn's own state as well as its inputs), for ``restore()`` to put back: an undone warm-up run
    then leaves nothing behind, as eager makes no such run. ``kept``: the addresses of storages
    the caller restores itself (not copied twice)."""

    def __init__(self, kept: frozenset[int] = frozenset()) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._made: set[int] = set(kept)  # storages the run allocated, or the caller restores
        self._before: set[int] = set()  # storages it got that existed before it
        self._saved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        args, kwargs = _plain(args, kwargs or {})
        made = self._made
        for t in _tensors([*args, *kwargs.values()]):
            if (ptr := _ptr(t)) not in made:
                self._before.add(ptr)
        if func.namespace in _TRUSTED:
            positions, names = write_positions(func)
            written = [*(args[i] for i in positions if i < len(args)),
                       *(kwargs.get(n) for n in names)]
        else:
            written = [*args, *kwargs.values()]
        for t in _tensors(written):
            ptr = _ptr(t)
            if ptr and ptr not in made and ptr not in self._saved:
                st = t.untyped_storage()
                self._saved[ptr] = (st, st.clone())  # type: ignore[no-untyped-call]
        result = super().__torch_dispatch__(func, types, args, kwargs)
        for t in _tensors([result]):
            if (ptr := _ptr(t)) not in self._before:
                made.add(ptr)  # a view of an earlier tensor keeps that tensor's storage
        return result

    def restore(self) -> None:
        saved, self._saved = self._saved, {}
        for st, before in saved.values():
            st.copy_(before)
