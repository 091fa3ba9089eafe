"""Scopes usable inside a compiled function (``fullgraph=True`` included).

``limit_core_num(op_aicore_num, op_vectorcore_num)`` limits the compute units the enclosed ops may
use (NPU: per-stream AI Core / Vector Core limits; elsewhere as the runtime documents)."""

from npugraph_runtime.core_limit import limit_core_num

__all__ = ["limit_core_num"]
