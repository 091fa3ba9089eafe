"""What the device's torch offers to limit compute units: Ascend NPU stream limits
(``torch.npu.get_stream_limit`` / ``set_stream_limit``) and CUDA green contexts
(``torch.cuda.green_contexts``). Each backend's ``core_limit_kind`` reads it, and so does
``npugraph_runtime.core_limit``, which applies the limits."""

from __future__ import annotations

import functools
from typing import Any

import torch


def npu_limit_api() -> tuple[Any, Any, Any] | None:
    """(get_stream_limit, set_stream_limit, get_device_limit or None) of torch_npu, or None."""
    npu = getattr(torch, "npu", None)
    if npu is None:
        return None
    get_limit = getattr(npu, "get_stream_limit", None)
    set_limit = getattr(npu, "set_stream_limit", None)
    if get_limit is None or set_limit is None:
        return None
    return get_limit, set_limit, getattr(npu, "get_device_limit", None)


@functools.cache
def green_context_class() -> Any:
    """``torch.cuda.green_contexts.GreenContext`` where this torch supports it, else None."""
    try:
        from torch.cuda import green_contexts
    except ImportError:
        return None
    return green_contexts.GreenContext if getattr(green_contexts, "SUPPORTED", False) else None
