"""Streams and events of any supported device, backed by its StreamBackend: CUDA/NPU streams and
events on accelerators, logical ones on the CPU (where an event orders a capture's streams and is
complete as soon as it is recorded outside a capture).

The user must guarantee what streams always need: a tensor written on one stream and used on
another is ordered by an event recorded after the write and waited for before the use (the CPU
capture reports a missing one with a CrossStreamWarning).

Inside a function compiled by ``torch.compile`` (``fullgraph=True`` included) nothing is switched
while tracing: ``stream(s)`` leaves ``npugraph_ex.scope_enter(["_user_stream_label"], [s.label])``
... ``scope_exit()`` in the graph, ``Event.record`` a ``npugraph_ex.record()`` token and
``Event.wait`` a ``npugraph_ex.wait([token])``; the backend lowers them to streams and events of
the graph. Streams used in compiled code are created outside it (a Stream made while tracing is
refused); events may be created inside."""

from __future__ import annotations

import itertools
import secrets
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from npugraph_runtime import _compat
from npugraph_runtime.devices import backend_for, device_of
from npugraph_runtime.errors import NpugraphError
from npugraph_runtime.scope_keys import USER_STREAM_LABEL

_LABELS = itertools.count(1)
# A label names a stream of a compiled graph, and a graph saved by one process (cache_compile) is
# run by others: a label made by a counter alone would name, in the loading process, whatever
# stream that process made in that place (another stream, perhaps of another device). The
# process's own random tag makes every label unique, so a loaded graph's labels name streams of
# its own (``ops.user_stream`` makes one per label), as a graph's streams should be.
_PROCESS_TAG = secrets.token_hex(4)
# label -> the live Stream of that label (weak: a stream nobody holds is not kept by its label)
_BY_LABEL: weakref.WeakValueDictionary[str, Stream] = weakref.WeakValueDictionary()


class Stream:
    """A stream of ``device`` (None: the current accelerator, else the CPU).

    ``label`` names the stream in compiled graphs (``scope_enter``'s ``"_user_stream_label"``);
    dynamo guards its value, so a call with another stream object compiles again. What a graph's
    meaning depends on is only which of its streams are one stream: ``__graph_stream_label__``
    (the protocol npugraph_cache reads, without importing us) names the attribute, so a saved
    graph is served to a process whose streams have other labels but the same aliasing."""

    __graph_stream_label__ = "label"

    def __init__(self, device: torch.device | str | None = None, *, _impl: Any = None) -> None:
        if _compat.compiling():
            raise NpugraphError(
                "npugraph_runtime.Stream() was called inside a compiled function: create the "
                "stream outside it and use it there with npugraph_runtime.stream(s)"
            )
        if _impl is None:
            dev = device_of(device)
            _impl = backend_for(dev).new_stream(dev)
        self.impl = _impl
        self.device: torch.device = _impl.device
        # the name compiled graphs give this stream (scope_enter's "_user_stream_label")
        self.label = f"stream_{next(_LABELS)}_{_PROCESS_TAG}"
        _BY_LABEL[self.label] = self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.impl == self.impl

    def __hash__(self) -> int:
        return hash(self.impl)

    def __repr__(self) -> str:
        return f"Stream({self.impl!r})"

    def synchronize(self) -> None:
        self.impl.synchronize()

    def query(self) -> bool:
        return bool(self.impl.query())

    def wait_event(self, event: Event) -> None:
        event.wait(self)

    def wait_stream(self, other: Stream) -> None:
        if _compat.compiling():
            event = Event(self.device)
            event.record(other)
            event.wait(self)
            return
        self.impl.wait_stream(stream_impl(other))

    def record_event(self, event: Event | None = None) -> Event:
        event = Event(self.device) if event is None else event
        event.record(self)
        return event


class Event:
    """An event of ``device``: ``record`` on a stream, ``wait`` on another to order them."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        # the graph's token of the last record() traced in compiled code (None: none yet)
        self.token: torch.Tensor | None = None
        if _compat.compiling():
            # lowered to an event of the graph: no device event, no lookups dynamo would guard
            self.device = torch.device("cpu") if device is None else torch.device(device)
            self.impl: Any = None
            return
        self.device = device_of(device)
        self.impl = backend_for(self.device).new_event(self.device)

    def record(self, stream: Stream | Any = None) -> None:
        if _compat.compiling():
            with _scope_of(stream):
                self.token = torch.ops.npugraph_ex.record()
            return
        raw = stream_impl(stream)
        if raw is None:
            self.impl.record()
        else:
            self.impl.record(raw)

    def wait(self, stream: Stream | Any = None) -> None:
        if _compat.compiling():
            if self.token is not None:  # else recorded before this graph ran: nothing to order
                with _scope_of(stream):
                    torch.ops.npugraph_ex.wait([self.token])
            return
        raw = stream_impl(stream)
        if raw is None:
            self.impl.wait()
        else:
            self.impl.wait(raw)

    def synchronize(self) -> None:
        self.impl.synchronize()

    def query(self) -> bool:
        return bool(self.impl.query())


def compiling() -> bool:
    """This thread is tracing the calling code for torch.compile: stream code then leaves graph
    ops. Not ``torch.compiler.is_compiling()`` alone, which is True in every thread while any
    one of them compiles (see ``_compat.compiling``)."""
    return _compat.compiling()


def stream_by_label(label: str) -> Stream | None:
    """The live ``Stream`` whose ``label`` is ``label``, or None."""
    return _BY_LABEL.get(label)


def stream_impl(stream: Stream | Any) -> Any:
    """The device's own stream object behind ``stream`` (ours or already the device's)."""
    return stream.impl if isinstance(stream, Stream) else stream


def current_stream(device: torch.device | str | None = None) -> Stream:
    """The current stream of ``device``. In compiled code: the stream current where it is used
    (it leaves no scope)."""
    if _compat.compiling():
        return _AMBIENT
    dev = device_of(device)
    return Stream(_impl=backend_for(dev).current_stream(dev))


@contextmanager
def stream(s: Stream | Any) -> Iterator[None]:
    """Run the body with ``s`` as the current stream of its device; None leaves it unchanged."""
    if s is None:
        yield
        return
    if _compat.compiling():
        with _scope_of(s):
            yield
        return
    raw = stream_impl(s)
    backend = backend_for(raw.device)
    previous = backend.current_stream(raw.device)
    backend.set_stream(raw)
    try:
        yield
    finally:
        backend.set_stream(previous)


@contextmanager
def _scope_of(s: Stream | Any) -> Iterator[None]:
    """While tracing: the graph scope that runs its body on ``s`` (None: the current stream)."""
    if s is None or s is _AMBIENT:
        yield
        return
    if not isinstance(s, Stream):
        raise NpugraphError(
            f"compiled code got stream {s!r}: inside torch.compile use an npugraph_runtime.Stream "
            "created outside the compiled function"
        )
    torch.ops.npugraph_ex.scope_enter([USER_STREAM_LABEL], [s.label])
    try:
        yield
    finally:
        torch.ops.npugraph_ex.scope_exit()


# what current_stream() gives compiled code: no stream of its own, "wherever it is used"
_AMBIENT = Stream.__new__(Stream)
_AMBIENT.impl = None
_AMBIENT.device = torch.device("cpu")
_AMBIENT.label = ""
