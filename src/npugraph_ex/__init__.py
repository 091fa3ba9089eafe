"""npugraph-ex: the public façade (shared/API.md).

``torch.compile(model, backend="npugraph_ex", options={...})`` needs no import of this package;
import it for ``CompilerConfig``, ``validate_options``, ``compile_fx`` (custom backends),
``graph_pool_handle``, ``register_replacement``, ``scope``, ``inference`` and ``hf`` (transformers'
``generate``). When torch_npu is installed and has no ``torch.npu.npugraph_ex`` of its own, this
package is also reachable under that name, as the Ascend documentation spells it.

The names are imported on first use, so that ``import npugraph_ex`` (and the ``npugraph-ex``
command's ``--help`` and ``--version``) does not pay for importing torch."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from npugraph_ex.__about__ import __version__

if TYPE_CHECKING:
    from npugraph_backend import CompilerConfig, OptionError, compile_fx
    from npugraph_passes import register_replacement
    from npugraph_runtime import graph_pool_handle

    from npugraph_ex import hf, inference, scope

__all__ = [
    "CompilerConfig",
    "OptionError",
    "__version__",
    "compile_fx",
    "graph_pool_handle",
    "hf",
    "inference",
    "register_replacement",
    "scope",
    "validate_options",
]

# name -> (module, attribute or None for the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "CompilerConfig": ("npugraph_backend", "CompilerConfig"),
    "OptionError": ("npugraph_backend", "OptionError"),
    "compile_fx": ("npugraph_backend", "compile_fx"),
    "register_replacement": ("npugraph_passes", "register_replacement"),
    "graph_pool_handle": ("npugraph_runtime", "graph_pool_handle"),
    "scope": ("npugraph_ex.scope", None),
    "inference": ("npugraph_ex.inference", None),
    "hf": ("npugraph_ex.hf", None),
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'npugraph_ex' has no attribute {name!r}")
    module = importlib.import_module(target[0])
    value = module if target[1] is None else getattr(module, target[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def validate_options(options: Mapping[str, object] | None) -> CompilerConfig:
    """Check backend options now, before ``torch.compile``: returns the ``CompilerConfig`` they
    make, or raises ``OptionError`` (a ``ValueError``; ``TypeError`` too for a non-callable
    custom pass) naming the option, the value and what is allowed.

    torch.compile hands options to the backend only when the first graph is compiled (the first
    call), and wraps any error there in ``torch._dynamo.exc.BackendCompilerFailed``; call this to
    get the plain ``OptionError`` at a place of your choosing."""
    from npugraph_backend import CompilerConfig

    return CompilerConfig.from_options(options)


def _alias_under_torch_npu() -> None:
    """Make ``torch.npu.npugraph_ex`` this module when torch_npu has none of its own."""
    try:
        importlib.import_module("torch_npu")
    except Exception:
        return
    import torch

    npu = getattr(torch, "npu", None)
    if npu is not None and not hasattr(npu, "npugraph_ex"):
        npu.npugraph_ex = sys.modules[__name__]
        sys.modules.setdefault("torch.npu.npugraph_ex", sys.modules[__name__])


# Only where torch_npu is installed: there the alias must exist as soon as this package is
# imported, which costs the torch import; elsewhere nothing here imports torch.
if importlib.util.find_spec("torch_npu") is not None:
    _alias_under_torch_npu()
