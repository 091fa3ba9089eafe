"""The device protocol every graph implementation follows, modelled on ``torch.accelerator.Graph``.

Three implementations: ``devices/cpu.py`` (emulated device graph), ``devices/accelerator.py``
(CUDA and Ascend NPU, one class parameterised by the torch device module). ``devices/__init__.py``
picks one per ``torch.device``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard, cast, runtime_checkable

import torch

from npugraph_runtime.errors import PolicyError

#: What an op that cannot be captured does (torch.cuda.graph's capture_error_mode): every device
#: graph, the capture policy and the backend's option accept exactly these.
CAPTURE_ERROR_MODES: tuple[str, ...] = ("global", "thread_local", "relaxed")


def check_capture_error_mode(capture_error_mode: object) -> None:
    """PolicyError naming the value and the allowed modes, unless it is one of them."""
    if capture_error_mode not in CAPTURE_ERROR_MODES:
        raise PolicyError(
            f"capture_error_mode={capture_error_mode!r} is not allowed: use 'global', "
            "'thread_local' or 'relaxed'"
        )


@dataclass(frozen=True)
class PoolHandle:
    """A memory pool that graphs can share. ``ident`` is the device's own handle (CUDA/NPU: the
    allocator's ``(int, int)`` pool id; CPU: an int of ours)."""

    device: torch.device
    ident: Any


def is_raw_pool_id(obj: object) -> TypeGuard[tuple[int, int]]:
    """True for an accelerator's own pool handle: the allocator's ``(int, int)`` pool id, what
    ``torch.cuda.graph_pool_handle()`` returns (bools are not ints here)."""
    return (
        isinstance(obj, tuple)
        and len(obj) == 2
        and all(isinstance(i, int) and not isinstance(i, bool) for i in obj)
    )


@runtime_checkable
class DeviceGraph(Protocol):
    device: torch.device
    # whether the capture computes what an eager run does (the CPU's records the ops it runs; an
    # accelerator's capture launches nothing): then it is a ComputingGraph too
    capture_computes: bool

    def capture_begin(self, pool: PoolHandle | None = None, capture_error_mode: str = "global") -> None: ...

    def capture_end(self) -> None: ...

    def replay(self) -> None: ...

    def reset(self) -> None: ...

    def pool(self) -> PoolHandle: ...


class ComputingGraph(DeviceGraph, Protocol):
    """A device graph whose capture computes (``capture_computes``): its run can be a call's, so
    it says which writes of that run stay and which collectives it launches."""

    # a successful capture keeps its writes to storages that existed before it
    keep_writes: bool
    # the capture's run launches the collectives it records (else they only stand in locally)
    launch_collectives: bool
    # keep what launched collectives left (``launched()``) for a capture made again to take
    # (``relaunch``) instead of launching them twice
    keep_launched: bool
    relaunch: list[Any]

    def launched(self) -> list[Any]: ...

    def stop_launching(self) -> None: ...

    def undo_writes(self) -> None: ...

    def drop_undo(self) -> None: ...


def computing(g: DeviceGraph) -> ComputingGraph | None:
    """``g`` as a ComputingGraph where its capture computes, else None."""
    return cast(ComputingGraph, g) if g.capture_computes else None


class DeviceBackend(Protocol):
    """What the runtime needs from one kind of device."""

    type: str
    # whether its graphs' captures compute (DeviceGraph.capture_computes)
    capture_computes: bool

    def new_graph(self, device: torch.device) -> DeviceGraph: ...

    def graph_pool_handle(self, device: torch.device) -> PoolHandle: ...

    def normalize(self, device: torch.device) -> torch.device: ...

    def pool_ident(self, pool: object, device: torch.device) -> Any:
        """The device's own id of ``pool`` (a PoolHandle of this device, or the device's raw
        handle), PolicyError or DeviceError naming what is allowed otherwise."""
        ...

    def pool_bytes(self, pool: PoolHandle) -> int: ...

    def synchronize(self, device: torch.device) -> None: ...

    def core_limit_kind(self, device: torch.device) -> str | None:
        """How ``limit_core_num`` limits compute units here: "threads" (CPU), "stream_limit"
        (NPU), "green_context" (CUDA), or None when this torch cannot limit them."""
        ...

    def capabilities(self, device: torch.device) -> dict[str, object]: ...


class StreamBackend(Protocol):
    """Streams and events of one kind of device (CPU: logical streams of the emulated graph)."""

    def new_stream(self, device: torch.device) -> Any: ...

    def current_stream(self, device: torch.device) -> Any: ...

    def set_stream(self, stream: Any) -> None: ...

    def new_event(self, device: torch.device) -> Any: ...


# The scope ops (streams, core limits) live above the device layer (ops.py). A CPU replay that
# raises inside such a scope exits the scopes it entered, as eager code's ``with`` would; it reads
# how through this seam, which ops.py fills when imported (a graph can record a scope marker only
# once ops.py has defined it).
_SCOPE_EXITS: list[tuple[Callable[[], int], Callable[[int], None]]] = []


def provide_scope_exits(depth: Callable[[], int], exit_to: Callable[[int], None]) -> None:
    """``depth()``: the scopes this thread has entered; ``exit_to(n)``: exit until n are left."""
    _SCOPE_EXITS[:] = [(depth, exit_to)]


def scope_exits() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    return _SCOPE_EXITS[0] if _SCOPE_EXITS else None
