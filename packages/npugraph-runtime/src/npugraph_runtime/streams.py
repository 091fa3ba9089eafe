"""Streams and events of any supported device, backed by its StreamBackend: CUDA/NPU streams and
events on accelerators, logical ones on the CPU (where an event orders a capture's streams and is
complete as soon as it is recorded outside a capture).

The user must guarantee what streams always need: a tensor written on one stream and used on
another is ordered by an event recorded after the write and waited for before the use (the CPU
capture reports a missing one with a CrossStreamWarning)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from npugraph_runtime.devices import backend_for


def _device(device: torch.device | str | None) -> torch.device:
    from npugraph_runtime.graphs import device_of

    return device_of(device)


class Stream:
    """A stream of ``device`` (None: the current accelerator, else the CPU)."""

    def __init__(self, device: torch.device | str | None = None, *, _impl: Any = None) -> None:
        if _impl is None:
            dev = _device(device)
            _impl = backend_for(dev).new_stream(dev)
        self.impl = _impl
        self.device: torch.device = _impl.device

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
        self.impl.wait_stream(stream_impl(other))

    def record_event(self, event: Event | None = None) -> Event:
        event = Event(self.device) if event is None else event
        event.record(self)
        return event


class Event:
    """An event of ``device``: ``record`` on a stream, ``wait`` on another to order them."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = _device(device)
        self.impl = backend_for(self.device).new_event(self.device)

    def record(self, stream: Stream | Any = None) -> None:
        raw = stream_impl(stream)
        if raw is None:
            self.impl.record()
        else:
            self.impl.record(raw)

    def wait(self, stream: Stream | Any = None) -> None:
        raw = stream_impl(stream)
        if raw is None:
            self.impl.wait()
        else:
            self.impl.wait(raw)

    def synchronize(self) -> None:
        self.impl.synchronize()

    def query(self) -> bool:
        return bool(self.impl.query())


def stream_impl(stream: Stream | Any) -> Any:
    """The device's own stream object behind ``stream`` (ours or already the device's)."""
    return stream.impl if isinstance(stream, Stream) else stream


def current_stream(device: torch.device | str | None = None) -> Stream:
    dev = _device(device)
    return Stream(_impl=backend_for(dev).current_stream(dev))


@contextmanager
def stream(s: Stream | Any) -> Iterator[None]:
    """Run the body with ``s`` as the current stream of its device; None leaves it unchanged."""
    if s is None:
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
