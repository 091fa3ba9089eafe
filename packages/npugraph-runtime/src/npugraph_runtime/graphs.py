"""Hand-written capture, modelled on ``torch.cuda.graphs``: ``Graph`` (the device graph of one
device), the ``graph`` context manager, pools and ``synchronize``.

    g = npugraph_runtime.Graph("cpu")
    with npugraph_runtime.graph(g):
        static_out = fn(static_in)     # recorded, not run for real
    static_in.copy_(new_data)
    g.replay()                         # static_out now holds fn(new_data)

The user must guarantee what any device graph needs: the tensors the function reads keep their
addresses (copy new data into them), the function does no host synchronisation, no
data-dependent shapes and no random numbers (or captures with ``capture_error_mode="relaxed"``
and accepts that replays repeat the captured values), and the outputs are read before the next
replay overwrites them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from npugraph_runtime.devices import backend_for, device_of
from npugraph_runtime.devices.base import DeviceGraph, PoolHandle
from npugraph_runtime.errors import DeviceError, PolicyError
from npugraph_runtime.streams import stream_impl


def Graph(device: torch.device | str | None = None) -> DeviceGraph:
    """A device graph of ``device`` ("cpu", "cuda", "npu", "cuda:1", a torch.device; None: the
    current accelerator, else the CPU), with ``capture_begin(pool=None,
    capture_error_mode="global")``, ``capture_end()``, ``replay()``, ``reset()`` and ``pool()``."""
    dev = device_of(device)
    graph: DeviceGraph = backend_for(dev).new_graph(dev)
    return graph


def graph_pool_handle(device: torch.device | str | None = None) -> PoolHandle:
    """A new memory pool of ``device``; graphs captured into one pool share its memory and must
    never be replayed at the same time."""
    dev = device_of(device)
    handle: PoolHandle = backend_for(dev).graph_pool_handle(dev)
    return handle


def as_pool_handle(obj: object, device: torch.device | str) -> PoolHandle:
    """``obj`` as a pool of ``device``: one of our PoolHandles, or the device's own raw handle
    (CUDA/NPU: the ``(int, int)`` of ``torch.cuda.graph_pool_handle()``; CPU: a pool id). The
    device backend's ``pool_ident`` decides what its raw handles are."""
    dev = device_of(device)
    if isinstance(obj, PoolHandle):
        if obj.device.type != dev.type:
            raise DeviceError(
                f"a pool of {obj.device} cannot be used by a graph of {dev}: get one with "
                f"graph_pool_handle({str(dev)!r})"
            )
        return obj
    backend = backend_for(dev)
    full = backend.normalize(dev)
    return PoolHandle(full, backend.pool_ident(obj, full))


def pool_bytes(pool: PoolHandle) -> int:
    """Bytes the pool holds now (CPU: its blocks; CUDA/NPU: the allocator's segments)."""
    if not isinstance(pool, PoolHandle):
        raise PolicyError(f"pool_bytes() takes a PoolHandle, got {pool!r}")
    return int(backend_for(pool.device).pool_bytes(pool))


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for all work queued on ``device`` (a no-op on the CPU)."""
    dev = device_of(device)
    backend_for(dev).synchronize(dev)


_SIDE_STREAMS: dict[torch.device, Any] = {}


@contextmanager
def graph(
    g: DeviceGraph,
    pool: object = None,
    stream: Any = None,
    capture_error_mode: str = "global",
) -> Iterator[DeviceGraph]:
    """Capture what the body runs into ``g``. Synchronizes the device, switches to ``stream``
    (accelerators: a side stream of ours when None, as capture may not run on the default stream),
    captures into ``pool`` (a PoolHandle, a device's raw handle, or None for the graph's own
    pool). If the body raises, the capture is abandoned and ``g`` is left uncaptured."""
    device = g.device
    backend = backend_for(device)
    handle = None if pool is None else as_pool_handle(pool, device)
    backend.synchronize(device)
    raw_stream = stream_impl(stream)
    if raw_stream is None and device.type != "cpu":
        raw_stream = _SIDE_STREAMS.get(device)
        if raw_stream is None:
            raw_stream = _SIDE_STREAMS[device] = backend.new_stream(device)
    previous = backend.current_stream(device) if raw_stream is not None else None
    if raw_stream is not None:
        if device.type != "cpu":
            raw_stream.wait_stream(previous)
        backend.set_stream(raw_stream)
    try:
        g.capture_begin(pool=handle, capture_error_mode=capture_error_mode)
        try:
            yield g
        except BaseException:
            _abandon(g)
            raise
        g.capture_end()
    finally:
        if previous is not None:
            if device.type != "cpu":
                previous.wait_stream(raw_stream)
            backend.set_stream(previous)


def _abandon(g: DeviceGraph) -> None:
    abort = getattr(g, "abort_capture", None)
    if abort is not None:
        abort()
        return
    with contextlib.suppress(Exception):  # the body's exception is the one the user needs
        g.capture_end()
    with contextlib.suppress(Exception):
        g.reset()
