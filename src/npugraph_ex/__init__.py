"""npugraph-ex: the public façade (shared/API.md).

``torch.compile(model, backend="npugraph_ex", options={...})`` needs no import of this package;
import it for ``CompilerConfig``, ``compile_fx`` (custom backends), ``graph_pool_handle``,
``register_replacement``, ``scope`` and ``inference``. When torch_npu is importable and has no
``torch.npu.npugraph_ex`` of its own, this package is also reachable under that name, as the
Ascend documentation spells it."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

import torch
from npugraph_backend import CompilerConfig, OptionError, compile_fx
from npugraph_passes import register_replacement
from npugraph_runtime import graph_pool_handle

from npugraph_ex import scope
from npugraph_ex.__about__ import __version__

__all__ = [
    "CompilerConfig",
    "OptionError",
    "__version__",
    "compile_fx",
    "graph_pool_handle",
    "inference",
    "register_replacement",
    "scope",
]


def __getattr__(name: str) -> Any:
    # The compile cache is imported on first use: it is not needed to compile or run.
    if name == "inference":
        module = importlib.import_module("npugraph_ex.inference")
        globals()["inference"] = module
        return module
    raise AttributeError(f"module 'npugraph_ex' has no attribute {name!r}")


def _alias_under_torch_npu() -> None:
    """Make ``torch.npu.npugraph_ex`` this module when torch_npu has none of its own."""
    if importlib.util.find_spec("torch_npu") is None:
        return
    try:
        importlib.import_module("torch_npu")
    except Exception:
        return
    npu = getattr(torch, "npu", None)
    if npu is not None and not hasattr(npu, "npugraph_ex"):
        npu.npugraph_ex = sys.modules[__name__]
        sys.modules.setdefault("torch.npu.npugraph_ex", sys.modules[__name__])


_alias_under_torch_npu()
