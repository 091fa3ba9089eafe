"""Device backends: one per kind of device, chosen by ``backend_for``."""

from __future__ import annotations

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
