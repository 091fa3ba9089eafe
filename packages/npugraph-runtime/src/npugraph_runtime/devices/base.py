"""The device protocol every graph implementation follows, modelled on ``torch.accelerator.Graph``.

Three implementations: ``devices/cpu.py`` (emulated device graph), ``devices/accelerator.py``
(CUDA and Ascend NPU, one class parameterised by the torch device module). ``devices/__init__.py``
picks one per ``torch.device``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class PoolHandle:
    """A memory pool that graphs can share. ``ident`` is the device's own handle (CUDA/NPU: the
    allocator's ``(int, int)`` pool id; CPU: an int of ours)."""

    device: torch.device
    ident: Any


@runtime_checkable
class DeviceGraph(Protocol):
    device: torch.device

    def capture_begin(self, pool: PoolHandle | None = None, capture_error_mode: str = "global") -> None: ...

    def capture_end(self) -> None: ...

    def replay(self) -> None: ...

    def reset(self) -> None: ...

    def pool(self) -> PoolHandle: ...


class DeviceBackend(Protocol):
    """What the runtime needs from one kind of device."""

    type: str

    def new_graph(self, device: torch.device) -> DeviceGraph: ...

    def graph_pool_handle(self, device: torch.device) -> PoolHandle: ...

    def pool_bytes(self, pool: PoolHandle) -> int: ...

    def synchronize(self, device: torch.device) -> None: ...

    def capabilities(self, device: torch.device) -> dict[str, object]: ...


class StreamBackend(Protocol):
    """Streams and events of one kind of device (CPU: logical streams of the emulated graph)."""

    def new_stream(self, device: torch.device) -> Any: ...

    def current_stream(self, device: torch.device) -> Any: ...

    def set_stream(self, stream: Any) -> None: ...

    def new_event(self, device: torch.device) -> Any: ...
