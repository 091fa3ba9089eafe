"""npugraph-runtime: device graphs on CPU (emulated), CUDA and Ascend NPU, with pools, streams,
core limits and a capture manager. Usable by hand, without torch.compile."""

from npugraph_runtime.__about__ import __version__
from npugraph_runtime.devices.base import DeviceGraph, PoolHandle
from npugraph_runtime.errors import (
    CaptureError,
    CrossStreamWarning,
    DeviceError,
    NpugraphError,
    PolicyError,
)
from npugraph_runtime.spec import CapturePolicy, InputSpec, OutputSpec, SlotKind

__all__ = [
    "CaptureError",
    "CapturePolicy",
    "CrossStreamWarning",
    "DeviceError",
    "DeviceGraph",
    "InputSpec",
    "NpugraphError",
    "OutputSpec",
    "PolicyError",
    "PoolHandle",
    "SlotKind",
    "__version__",
]
