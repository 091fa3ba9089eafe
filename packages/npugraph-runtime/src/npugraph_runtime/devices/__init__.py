"""Device backends: one per kind of device, chosen by ``backend_for``, and device lookup
(``device_type``, ``device_of``, ``inputs_device``).

devices/ is the runtime's bottom layer. Its modules import only torch, each other, and these
leaf modules of the runtime, which import nothing of ours but one another:

* ``npugraph_runtime.errors`` (the error types),
* ``npugraph_runtime._compat`` (private torch APIs),
* ``npugraph_runtime.schema`` (reading an operator's schema),
* ``npugraph_runtime.spans`` (the bytes a tensor may touch).

Everything else of the runtime (graphs, streams, ops, core_limit, inputs, manager, ...) sits above
and may import devices/, never the reverse; ``tests/test_layering.py`` checks it. The backends
(``devices.cpu``, ``devices.accelerator``) are imported on first use by ``backend_for``, so a
process that only runs on CPU never loads the accelerator module (nor torch_npu)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from npugraph_runtime.errors import DeviceError

SUPPORTED = ("cpu", "cuda", "npu")
_BACKENDS: dict[str, Any] = {}


def device_type(device: torch.device | str | None) -> str:
    if isinstance(device, torch.device):
        return device.type
    if device is None:
        return "cpu"
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError, ValueError):
        # torch parses "npu" only once torch_npu is imported: let the NPU backend say how to get it
        if isinstance(device, str) and device.split(":", 1)[0] == "npu":
            return "npu"
        raise DeviceError(
            f"device {device!r} is not supported: npugraph-ex runs on "
            + ", ".join(repr(s) for s in SUPPORTED)
        ) from None


def backend_for(device: torch.device | str) -> Any:
    """The DeviceBackend (and StreamBackend) of ``device``: "cpu" is the emulated graph, "cuda"
    and "npu" the accelerator graph over ``torch.cuda`` / ``torch.npu`` (torch_npu is imported only
    here, on first use). Anything else raises DeviceError."""
    kind = device_type(device)
    backend = _BACKENDS.get(kind)
    if backend is not None:
        return backend
    if kind == "cpu":
        from npugraph_runtime.devices.cpu import CpuBackend

        backend = CpuBackend()
    elif kind in ("cuda", "npu"):
        try:
            from npugraph_runtime.devices.accelerator import AcceleratorBackend
        except ModuleNotFoundError as e:
            if e.name != "npugraph_runtime.devices.accelerator":
                raise
            raise DeviceError(
                f"device {str(device)!r}: this build of npugraph-runtime has no accelerator backend"
            ) from e
        backend = AcceleratorBackend(kind)
    else:
        raise DeviceError(
            f"device {str(device)!r} is not supported: npugraph-ex runs on "
            + ", ".join(repr(s) for s in SUPPORTED)
        )
    _BACKENDS[kind] = backend
    return backend


def device_of(x: object) -> torch.device:
    """The device named by ``x``: a device, a string, a tensor, or anything with a ``.device``
    (a graph, a pool); None is the current accelerator when one is available, else the CPU. For a
    graph's example inputs, ``inputs_device``."""
    if x is None:
        accelerator = getattr(torch, "accelerator", None)
        current = getattr(accelerator, "current_accelerator", None)
        # check_available: a CUDA build on a host without a GPU names cuda otherwise (2.11, 2.13)
        found = current(check_available=True) if current is not None else None
        if found is not None and found.type in ("cuda", "npu"):
            return torch.device(found.type)
        return torch.device("cpu")
    if isinstance(x, torch.device):
        return x
    if isinstance(x, str):
        # unknown strings raise DeviceError naming what is supported; "npu" imports torch_npu
        # first (which teaches torch that device type) or says how to install it
        if device_type(x) == "npu":
            backend_for(x)
        return torch.device(x)
    if isinstance(x, torch.Tensor):
        return x.device
    device = getattr(x, "device", None)
    if isinstance(device, torch.device):
        return device
    raise DeviceError(f"cannot tell the device of {x!r}: give 'cpu', 'cuda', 'npu' or a torch.device")


def inputs_device(example_inputs: Sequence[object]) -> torch.device:
    """The device of a graph's example inputs: that of their tensors, which must agree (CPU
    tensors next to one accelerator's belong to it; meta tensors do not count); CPU for a graph
    without tensors. Otherwise DeviceError naming the devices."""
    devices = {x.device for x in example_inputs if isinstance(x, torch.Tensor)}
    devices.discard(torch.device("meta"))
    if not devices:
        return torch.device("cpu")
    if len(devices) > 1:
        accel = {d for d in devices if d.type != "cpu"}
        # CPU scalars next to accelerator tensors are common (indices, lengths): the graph
        # belongs to the accelerator; the runtime refuses truly mixed captures.
        if len(accel) == 1:
            return accel.pop()
        raise DeviceError(
            f"graph inputs are on several devices {sorted(str(d) for d in devices)}; "
            "a captured graph runs on one device"
        )
    return devices.pop()
