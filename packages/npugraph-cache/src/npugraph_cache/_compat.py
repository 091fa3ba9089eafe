"""Every private torch API the cache touches, each with the torch versions it was checked on.
A torch upgrade is a change to this file only."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch

Backend = Callable[[torch.fx.GraphModule, list[Any]], Any]


# --- compile_cache.py: ahead-of-time compile, save and load of one dynamo frame ----------------
def has_aot_compile() -> bool:
    """Checked on torch 2.13.0: ``torch.compile(...).aot_compile`` (``torch._dynamo.aot_compile``)
    and the public ``torch.compiler.load_compiled_function``; both exist since torch 2.10."""
    try:
        import torch._dynamo.aot_compile as aot

        return hasattr(aot, "AOTCompiledFunction") and hasattr(
            torch.compiler, "load_compiled_function"
        )
    except ImportError:
        return False


def aot_compile(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backend: Backend,
    dynamic: bool,
) -> Any:
    """Checked on torch 2.13.0: ``torch.compile(fullgraph=True).aot_compile(((args), {kwargs}))``
    traces ``fn`` once, keeps its guards, and returns an ``AOTCompiledFunction``.

    ``torch._dynamo.config.specialize_float`` is set: with dynamic=True dynamo makes Python
    floats symbolic and AOT's tensorify pass then asks for a restart with the float specialised,
    which torch.compile does but aot_compile cannot (TensorifyScalarRestartAnalysis escapes);
    specialising up front gives the graph the restart would have given."""
    import torch._dynamo.config as dynamo_config

    compiled = torch.compile(fn, fullgraph=True, backend=backend, dynamic=dynamic)
    with dynamo_config.patch(specialize_float=True):
        return compiled.aot_compile((args, kwargs))  # type: ignore[attr-defined]


def serialize_compiled(compiled: Any) -> bytes:
    """Checked on torch 2.13.0: ``AOTCompiledFunction.serialize(fn).serialized_data``; the public
    ``save_compiled_function(path)`` writes straight to a file, we need the bytes for our format."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    data: bytes = AOTCompiledFunction.serialize(compiled).serialized_data
    return data


def load_compiled(data: bytes, f_globals: dict[str, object]) -> Any:
    """Public API (torch.compiler.load_compiled_function), checked on torch 2.13.0."""
    return torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=f_globals)


def guard_check(compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Checked on torch 2.13.0: ``AOTCompiledFunction.guard_check(*args, **kwargs)`` (the frame's
    guards: tensor dtypes/shapes/strides, global state such as grad mode and thread count)."""
    return bool(compiled.guard_check(*args, **kwargs))


def guard_failure_reason(compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Checked on torch 2.13.0: ``_artifacts.guard_manager.check_verbose(f_locals)``."""
    try:
        f_locals = compiled.prepare_f_locals(*args, **kwargs)
        return str(compiled._artifacts.guard_manager.check_verbose(f_locals).verbose_code_parts)
    except Exception as exc:  # the reason is only for a log line
        return f"(reason unavailable: {exc})"


def disable_guard_check(compiled: Any) -> None:
    """Checked on torch 2.13.0: ``AOTCompiledFunction.disable_guard_check()``; we check the guards
    ourselves first (to pick among entries), so the call itself need not check them again."""
    disable = getattr(compiled, "disable_guard_check", None)
    if disable is not None:
        disable()


def eager_serializable(gm: torch.fx.GraphModule) -> Any:
    """Checked on torch 2.13.0: ``GraphModuleSerializableCallable`` runs the dynamo graph as is
    and pickles it with ``GraphPickler``."""
    from torch._dynamo.aot_compile_types import GraphModuleSerializableCallable

    return GraphModuleSerializableCallable(gm)


def dynamo_counters() -> Any:
    """Checked on torch 2.13.0: ``torch._dynamo.utils.counters`` (a defaultdict of Counters)."""
    from torch._dynamo.utils import counters

    return counters


# --- rng.py: which ATen ops draw random numbers ------------------------------------------------
def is_seeded_op(target: object) -> bool:
    """Checked on torch 2.13.0: ``torch._ops.OpOverload(Packet)`` and their ``tags``; an op tagged
    ``nondeterministic_seeded`` reads the RNG state."""
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    if isinstance(target, torch._ops.OpOverloadPacket):
        return any(
            torch.Tag.nondeterministic_seeded in getattr(target, name).tags
            for name in target.overloads()  # type: ignore[no-untyped-call]
        )
    return False
