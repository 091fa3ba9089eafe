"""Graph-level marker ops of namespace ``npugraph_ex``, and the user-stream registry.

Importing ``npugraph_runtime`` registers (once per process):

* ``torch.ops.npugraph_ex.scope_enter(str[] keys, str[] values) -> ()``: push ``dict(zip(keys,
  values))`` on this thread's scope stack;
* ``torch.ops.npugraph_ex.scope_exit() -> ()``: pop it;
* ``torch.ops.npugraph_ex.record() -> Tensor``: a small token tensor marking a point of the graph;
* ``torch.ops.npugraph_ex.wait(Tensor[] nodes) -> ()``: a marker that the following nodes wait for
  the recorded points (no-op when run eagerly).

All four are side-effecting: FX dead-code elimination keeps them and AOT keeps them in program
order, so a custom pass or the backend can lower them. They have fake kernels, so dynamo and AOT
trace them. A scope whose keys include ``"_user_stream_label"`` means the enclosed nodes run on the
stream registered under that label (see :func:`user_stream`); the backend does that lowering, the
ops themselves only keep the scope stack. A scope with ``"_op_aicore_num"`` / ``"_op_vectorcore_num"``
is what :class:`~npugraph_runtime.core_limit.limit_core_num` leaves in a compiled graph.

The backend's lowering adds the key ``"_device"`` (the graph's device) to those scopes: a scope
with it is *applied* when it runs (in a capture, at every replay, and eagerly): a user-stream scope
makes that stream current on its device, a core-limit scope enters ``limit_core_num`` on the
device, and ``scope_exit`` undoes it. The lowering also turns record/wait pairs into
``npugraph_ex.event_record(str tag, str device)`` / ``event_wait(tag, device)``: the event of the
graph named ``tag`` (created on first use) is recorded on / waited for by the current stream.

If another library (torch_npu's own npugraph_ex) already defined an op of the same name, that
definition is kept and ours is not registered."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from npugraph_runtime._compat import mark_side_effectful
from npugraph_runtime.core_limit import current_core_limit, limit_core_num
from npugraph_runtime.devices import backend_for
from npugraph_runtime.devices.base import provide_scope_exits
from npugraph_runtime.errors import NpugraphError

# the scope keys are re-exported: ``npugraph_runtime.ops.USER_STREAM_LABEL`` & co. stay where they were
from npugraph_runtime.scope_keys import AICORE_KEY as AICORE_KEY
from npugraph_runtime.scope_keys import DEVICE_KEY as DEVICE_KEY
from npugraph_runtime.scope_keys import NAMESPACE as NAMESPACE
from npugraph_runtime.scope_keys import USER_STREAM_LABEL as USER_STREAM_LABEL
from npugraph_runtime.scope_keys import VECTORCORE_KEY as VECTORCORE_KEY
from npugraph_runtime.streams import Event, Stream, stream_by_label, stream_impl

_SCHEMAS = {
    "scope_enter": "scope_enter(str[] keys, str[] values) -> ()",
    "scope_exit": "scope_exit() -> ()",
    "record": "record() -> Tensor",
    "wait": "wait(Tensor[] nodes) -> ()",
    "event_record": "event_record(str tag, str device) -> ()",
    "event_wait": "event_wait(str tag, str device) -> ()",
}


class _ScopeStack(threading.local):
    def __init__(self) -> None:
        self.scopes: list[dict[str, str]] = []
        self.undo: list[list[Any]] = []


_stack = _ScopeStack()


def current_scope() -> dict[str, str]:
    """The scope in force on this thread: the entered scopes merged, inner keys winning. A copy."""
    merged: dict[str, str] = {}
    for scope in _stack.scopes:
        merged.update(scope)
    return merged


def scope_stack() -> tuple[dict[str, str], ...]:
    """Every scope entered on this thread and not yet exited, outermost first (copies)."""
    return tuple(dict(s) for s in _stack.scopes)


def _scope_enter(keys: Sequence[str], values: Sequence[str]) -> None:
    if len(keys) != len(values):
        raise NpugraphError(
            f"npugraph_ex.scope_enter got {len(keys)} keys and {len(values)} values; "
            "give one value per key"
        )
    scope = dict(zip(keys, values, strict=True))
    undo = _apply(scope)
    _stack.scopes.append(scope)
    _stack.undo.append(undo)


def _apply(scope: dict[str, str]) -> list[Any]:
    """Make a lowered scope (one with ``"_device"``) take effect; returns how to undo it."""
    device = scope.get(DEVICE_KEY)
    undo: list[Any] = []
    if device is None:
        return undo
    label = scope.get(USER_STREAM_LABEL)
    if label is not None:
        raw = stream_impl(user_stream(label, device))
        backend = backend_for(raw.device)
        previous = backend.current_stream(raw.device)
        backend.set_stream(raw)
        undo.append(lambda: backend.set_stream(previous))
        inherited = current_core_limit()
        if AICORE_KEY not in scope and inherited is not None and inherited[0] == "npu":
            # an NPU limit belongs to a stream: the side stream runs under the enclosing one too
            # (CPU threads and CUDA green contexts are not per stream: already in force)
            inner = limit_core_num(inherited[1], inherited[2], device=raw.device)
            inner.__enter__()
            undo.append(lambda: inner.__exit__(None, None, None))
    if AICORE_KEY in scope:
        limit = limit_core_num(
            int(scope[AICORE_KEY]), int(scope.get(VECTORCORE_KEY, "0")), device=device
        )
        limit.__enter__()
        undo.append(lambda: limit.__exit__(None, None, None))
    return undo


def _scope_exit() -> None:
    if not _stack.scopes:
        raise NpugraphError(
            "npugraph_ex.scope_exit was called with no scope entered on this thread; "
            "every scope_exit needs an earlier scope_enter"
        )
    _stack.scopes.pop()
    for undo in reversed(_stack.undo.pop()):
        undo()


def restoring_scopes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a graph holding scope ops), leaving this thread's scopes as it found them when it
    raises between a ``scope_enter`` and its ``scope_exit``: the scopes it entered are exited, so
    their stream stops being current, as a ``with`` block of eager code would do. Otherwise every
    later op of the thread (other graphs, eager code) stays on that side stream."""

    def run(*args: Any) -> Any:
        depth = len(_stack.scopes)
        try:
            return fn(*args)
        except BaseException:
            exit_scopes(depth)
            raise

    return run


def scope_depth() -> int:
    """How many scopes this thread has entered and not exited."""
    return len(_stack.scopes)


def exit_scopes(depth: int) -> None:
    """Exit this thread's innermost scopes until ``depth`` are left (after an error inside them)."""
    while len(_stack.scopes) > depth:
        _scope_exit()


# the CPU replay exits these scopes when it raises inside them (devices/base.py's seam)
provide_scope_exits(scope_depth, exit_scopes)


def _record() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int8)


def _record_fake() -> torch.Tensor:
    return torch.empty(1, dtype=torch.int8)


def _wait(nodes: Sequence[torch.Tensor]) -> None:
    # A marker: eagerly everything already ran in order on one stream.
    return None


def _nothing(*args: object) -> None:
    return None


_events_lock = threading.Lock()
_graph_events: dict[str, Any] = {}


def graph_event(tag: str, device: str) -> Any:
    """The event of a compiled graph named ``tag`` (an ``npugraph_runtime.Event`` of ``device``),
    created on first use."""
    with _events_lock:
        event = _graph_events.get(tag)
        if event is None:
            event = _graph_events[tag] = Event(device)
        return event


def forget_graph_events(prefix: str) -> None:
    """Drop the events of the graph whose tags start with ``prefix`` (the graph is gone)."""
    with _events_lock:
        for tag in [t for t in _graph_events if t.startswith(prefix)]:
            del _graph_events[tag]


def _event_record(tag: str, device: str) -> None:
    graph_event(tag, device).record()


def _event_wait(tag: str, device: str) -> None:
    graph_event(tag, device).wait()


_IMPLS: dict[str, tuple[Any, Any]] = {
    "scope_enter": (_scope_enter, _nothing),
    "scope_exit": (_scope_exit, _nothing),
    "record": (_record, _record_fake),
    "wait": (_wait, _nothing),
    "event_record": (_event_record, _nothing),
    "event_wait": (_event_wait, _nothing),
}

# torch.library is untyped; one Any-typed alias keeps mypy --strict quiet at every call.
_Library: Any = torch.library.Library
_lib: Any = None


def _defined(name: str) -> bool:
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def register() -> None:
    """Define the ops if nobody has (idempotent). Called when ``npugraph_runtime`` is imported."""
    global _lib
    if _lib is not None:
        return
    lib = _Library(NAMESPACE, "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        if _defined(name):
            continue
        lib.define(schema)
        real, fake = _IMPLS[name]
        lib.impl(name, real, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
        mark_side_effectful(getattr(getattr(torch.ops, NAMESPACE), name).default)
    _lib = lib


# --- user streams -------------------------------------------------------------------------------

_streams_lock = threading.Lock()
_user_streams: dict[str, Any] = {}


def register_user_stream(label: str, stream: Any) -> None:
    """Make ``label`` name ``stream`` (an ``npugraph_runtime.Stream`` or a device stream) for every
    ``scope_enter(["_user_stream_label"], [label])`` lowered after this call."""
    if not isinstance(label, str) or not label:
        raise NpugraphError(f"user stream label {label!r} is not allowed: give a non-empty str")
    with _streams_lock:
        _user_streams[label] = stream


def user_stream(label: str, device: torch.device | str | None = None) -> Any:
    """The stream registered under ``label``, else the live ``npugraph_runtime.Stream`` whose
    ``.label`` it is; an unknown label gets a new ``Stream(device)``,
    registered, so every lowering of one label in this process uses one stream."""
    if not isinstance(label, str) or not label:
        raise NpugraphError(f"user stream label {label!r} is not allowed: give a non-empty str")
    with _streams_lock:
        found = _user_streams.get(label)
        if found is None:
            found = stream_by_label(label)  # an npugraph_runtime.Stream used in compiled code
            if found is not None:
                return found
            found = _user_streams[label] = Stream(device)
        return found


def forget_user_streams() -> None:
    """Drop every label (tests, or a process that rebuilds its models)."""
    with _streams_lock:
        _user_streams.clear()


register()
