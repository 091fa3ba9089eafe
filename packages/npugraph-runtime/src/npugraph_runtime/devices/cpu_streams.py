"""Logical streams and events of the emulated CPU device.

CPU work runs in program order, so outside a capture a stream is only a label and an event is
complete as soon as it is recorded. During a capture every recorded op carries the current stream
and event record/wait calls are recorded too; the capture reports a tensor written on one stream
and used on another with no event ordering the two (what would be a race on a real device)."""

from __future__ import annotations

import itertools
import threading
from typing import Any, Protocol

import torch

_CPU = torch.device("cpu")
_IDS = itertools.count(1)


class CpuStream:
    """A logical CPU stream. ``CpuStream.default`` is the stream ops use unless told otherwise."""

    device = _CPU

    def __init__(self, _ident: int | None = None) -> None:
        self.id = next(_IDS) if _ident is None else _ident

    def __repr__(self) -> str:
        return "cpu default stream" if self.id == 0 else f"cpu stream {self.id}"

    def synchronize(self) -> None:
        """CPU work is already done when Python gets control back."""

    def query(self) -> bool:
        return True

    def wait_event(self, event: CpuEvent) -> None:
        event.wait(self)

    def wait_stream(self, other: CpuStream) -> None:
        event = CpuEvent()
        event.record(other)
        event.wait(self)

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        event = CpuEvent() if event is None else event
        event.record(self)
        return event


DEFAULT_STREAM = CpuStream(0)


class EventHooks(Protocol):
    """What an active capture does with events (implemented by the CPU recorder)."""

    def event_record(self, event: CpuEvent, stream: CpuStream) -> None: ...

    def event_wait(self, event: CpuEvent, stream: CpuStream) -> None: ...


class _State(threading.local):
    stream: CpuStream = DEFAULT_STREAM
    hooks: EventHooks | None = None


_STATE = _State()


def current_cpu_stream() -> CpuStream:
    return _STATE.stream


def set_cpu_stream(stream: CpuStream) -> None:
    _STATE.stream = stream


def set_event_hooks(hooks: EventHooks | None) -> None:
    _STATE.hooks = hooks


class CpuEvent:
    """A logical CPU event: trivially complete outside a capture, an ordering edge inside one."""

    device = _CPU

    def record(self, stream: CpuStream | None = None) -> None:
        hooks = _STATE.hooks
        if hooks is not None:
            hooks.event_record(self, _STATE.stream if stream is None else stream)

    def wait(self, stream: CpuStream | None = None) -> None:
        hooks = _STATE.hooks
        if hooks is not None:
            hooks.event_wait(self, _STATE.stream if stream is None else stream)

    def synchronize(self) -> None:
        """Nothing to wait for on the CPU."""

    def query(self) -> bool:
        return True


# npugraph_ex ops a replay re-issues: lowered scopes switch the logical stream and apply core
# limits when they run (see npugraph_runtime.ops).
_REPLAYED_MARKERS = frozenset({"scope_enter", "scope_exit"})
# Graph events order the streams of a capture (the hazard check); a replay runs every op in
# program order, where they order nothing, so it skips them (each costs a dispatch).
_EVENT_MARKERS = frozenset({"event_record", "event_wait"})


def _marker_name(func: Any) -> str | None:
    if getattr(func, "namespace", None) != "npugraph_ex":
        return None
    return str(func._schema.name).split("::")[-1]


def replays_marker(func: Any) -> bool:
    """Whether ``func`` is an ``npugraph_ex`` scope op, which a replay runs again."""
    return _marker_name(func) in _REPLAYED_MARKERS


def is_event_marker(func: Any) -> bool:
    """Whether ``func`` is an ``npugraph_ex`` graph-event op, which a replay leaves out."""
    return _marker_name(func) in _EVENT_MARKERS


class HazardTracker:
    """Vector clocks over the streams of one capture. ``access`` returns a message for the first
    read-after-write or write-after-write between two streams that no event orders, else None."""

    def __init__(self) -> None:
        self._seen: dict[CpuStream, dict[CpuStream, int]] = {}
        self._recorded: dict[CpuEvent, dict[CpuStream, int]] = {}
        self._last_write: dict[int, tuple[int, CpuStream, str]] = {}

    def _clock(self, stream: CpuStream) -> dict[CpuStream, int]:
        clock = self._seen.get(stream)
        if clock is None:
            clock = self._seen[stream] = {}
        return clock

    def access(
        self, index: int, name: str, stream: CpuStream, reads: set[int], writes: set[int]
    ) -> str | None:
        clock = self._clock(stream)
        clock[stream] = index
        problem = None
        for storage in reads | writes:
            last = self._last_write.get(storage)
            if last is None or problem is not None:
                continue
            w_index, w_stream, w_name = last
            if w_stream is not stream and clock.get(w_stream, -1) < w_index:
                problem = (
                    f"{name} on {stream!r} uses a tensor that {w_name} wrote on {w_stream!r} "
                    f"with no event between them: record an Event on {w_stream!r} after the write "
                    f"and wait for it on {stream!r} before the use"
                )
        for storage in writes:
            self._last_write[storage] = (index, stream, name)
        return problem

    def record(self, event: CpuEvent, stream: CpuStream) -> None:
        self._recorded[event] = dict(self._clock(stream))

    def wait(self, event: CpuEvent, stream: CpuStream) -> None:
        clock = self._clock(stream)
        for other, index in self._recorded.get(event, {}).items():
            if clock.get(other, -1) < index:
                clock[other] = index
