"""Python's cyclic garbage collector, paused while a capture works.

A capture allocates many small objects (the recorder's entries, the replay's closure), enough to
trigger a collection; after torch.compile the collection that comes due is a full one, and it
scans the whole heap the compile left: 220-260 ms after compiling bench (k)'s small decoder,
more than all of its captures together. Paused, the collection runs after the capture's work,
where the allocations that follow trigger it (or where the caller collects). A capture allocates
a bounded number of objects, so the pause holds no memory for long."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["collector_paused"]


class _Pause:
    """Pauses in progress (any thread) and whether the collector was on before the first: the
    last one to end turns it back on, so concurrent captures do not turn it on under each other,
    and a collector the caller had turned off stays off."""

    lock = threading.Lock()
    depth = 0
    resume = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (explicit ``gc.collect()`` calls still run)."""
    with _Pause.lock:
        if _Pause.depth == 0:
            _Pause.resume = gc.isenabled()
            gc.disable()
        _Pause.depth += 1
    try:
        yield
    finally:
        with _Pause.lock:
            _Pause.depth -= 1
            if _Pause.depth == 0 and _Pause.resume:
                gc.enable()
