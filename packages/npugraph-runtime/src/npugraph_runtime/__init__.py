"""npugraph-runtime: device graphs on CPU (emulated), CUDA and Ascend NPU, with pools, streams,
core limits and a capture manager. Usable by hand, without torch.compile."""

# ops: importing it registers torch.ops.npugraph_ex.{scope_enter, scope_exit, record, wait}.
from npugraph_runtime import ops
from npugraph_runtime.__about__ import __version__
from npugraph_runtime.core_limit import (
    capture_core_limit,
    current_core_limit,
    limit_core_num,
    max_core_num,
)
from npugraph_runtime.devices.base import DeviceGraph, PoolHandle
from npugraph_runtime.devices.cpu import CpuGraph
from npugraph_runtime.errors import (
    CaptureError,
    CrossStreamWarning,
    DeviceError,
    NpugraphError,
    PolicyError,
)
from npugraph_runtime.graphs import Graph, graph, graph_pool_handle, pool_bytes, synchronize
from npugraph_runtime.manager import CaptureEvent, GraphedCallable, make_graphed_callable
from npugraph_runtime.ops import current_scope, register_user_stream, user_stream
from npugraph_runtime.spec import CapturePolicy, InputSpec, OutputSpec, SlotKind
from npugraph_runtime.streams import Event, Stream, current_stream, stream

__all__ = [
    "CaptureError",
    "CaptureEvent",
    "CapturePolicy",
    "CpuGraph",
    "CrossStreamWarning",
    "DeviceError",
    "DeviceGraph",
    "Event",
    "Graph",
    "GraphedCallable",
    "InputSpec",
    "NpugraphError",
    "OutputSpec",
    "PolicyError",
    "PoolHandle",
    "SlotKind",
    "Stream",
    "__version__",
    "capture_core_limit",
    "current_core_limit",
    "current_scope",
    "current_stream",
    "graph",
    "graph_pool_handle",
    "limit_core_num",
    "make_graphed_callable",
    "max_core_num",
    "ops",
    "pool_bytes",
    "register_user_stream",
    "stream",
    "synchronize",
    "user_stream",
]
