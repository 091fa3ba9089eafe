"""What a cache entry is valid for.

Every field that can change the compiled result is part of the key: a change in any of them
gives another entry, never a stale hit. Guards (kept by torch's aot_compile) check the rest at
call time.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib.metadata
import inspect
import json
import platform
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from npugraph_cache.__about__ import __version__
from npugraph_cache.code_digest import code_digest
from npugraph_cache.format import FORMAT_VERSION

_MAX_DEPTH = 16


def _sha(text: str | bytes) -> str:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


def source_digest(obj: Any) -> str:
    """sha256 of an object's source; for code without source (a REPL, exec) its bytecode and
    constants, which still change when the code does."""
    target = getattr(obj, "__func__", obj)
    try:
        return _sha(inspect.getsource(target))
    except (OSError, TypeError):
        code = getattr(target, "__code__", None)
        if not isinstance(code, types.CodeType):
            return _sha(repr(target))
        return code_digest(code)


def stable_value(value: Any, depth: int = 0) -> Any:
    """A JSON-able, process-independent description of an option value: callables by their
    qualified name and source digest (a user pass is keyed by its code), containers recursively."""
    if depth > _MAX_DEPTH:
        return "<too deep>"
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, Mapping):
        return {
            str(k): stable_value(v, depth + 1)
            for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
        }
    if isinstance(value, list | tuple):
        return [stable_value(v, depth + 1) for v in value]
    if isinstance(value, set | frozenset):
        return sorted(str(stable_value(v, depth + 1)) for v in value)
    identity = getattr(value, "identity", None)
    if callable(identity):
        return {"identity": str(identity())}
    if callable(value):
        name = getattr(value, "__qualname__", None) or type(value).__qualname__
        module = getattr(value, "__module__", None) or ""
        return {"callable": f"{module}.{name}", "source": source_digest(value)}
    return {"type": type(value).__qualname__, "repr": repr(value)}


def options_digest(options: Mapping[str, Any] | None) -> str:
    return _sha(json.dumps(stable_value(dict(options or {})), sort_keys=True))


def decompositions_digest(decompositions: Mapping[Any, Any] | None) -> str:
    if not decompositions:
        return ""
    items = sorted((str(op), source_digest(fn)) for op, fn in decompositions.items())
    return _sha(json.dumps(items))


def _tensor_spec(t: torch.Tensor, dynamic: bool, symbols: dict[int, str]) -> dict[str, Any]:
    if dynamic:
        # Mirrors dynamo with dynamic=True: 0 and 1 are specialised, equal sizes share a symbol
        # (duck shaping), every other size is free.
        shape: list[Any] = []
        for size in t.shape:
            if size in (0, 1):
                shape.append(size)
            else:
                shape.append(symbols.setdefault(size, f"s{len(symbols)}"))
    else:
        shape = list(t.shape)
    return {
        "tensor": str(t.dtype),
        "device": str(t.device),
        "shape": shape,
        "contiguous": t.is_contiguous(),
        "requires_grad": t.requires_grad,
        "subclass": type(t).__qualname__
        if type(t) not in (torch.Tensor, torch.nn.Parameter)
        else None,
    }


def input_spec(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], dynamic: bool, float_values: bool = True
) -> Any:
    """dtypes, devices and shapes (or dynamic dims) of every tensor reachable through lists,
    tuples, dicts and dataclasses; scalars by type (and value when static, 0/1 when dynamic;
    an argument that is a float by value only when ``float_values``, see _compat.aot_compile)."""
    symbols: dict[int, str] = {}

    def walk(value: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            return "<too deep>"
        if isinstance(value, torch.Tensor):
            return _tensor_spec(value, dynamic, symbols)
        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, float):
            return {"float": "dynamic" if not (float_values or depth) and type(value) is float
                    else value}
        if isinstance(value, int):
            if dynamic and value not in (0, 1):
                # symbolic: a specialisation would be a SHAPE_ENV guard, which is kept
                return {"int": "dynamic"}
            return {"int": value}
        if isinstance(value, list | tuple):
            return {type(value).__name__: [walk(v, depth + 1) for v in value]}
        if isinstance(value, Mapping):
            return {"dict": {str(k): walk(v, depth + 1) for k, v in value.items()}}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {
                "dataclass": f"{type(value).__module__}.{type(value).__qualname__}",
                "fields": {
                    f.name: walk(getattr(value, f.name), depth + 1)
                    for f in dataclasses.fields(value)
                },
            }
        if isinstance(value, torch.dtype | torch.device | enum.Enum):
            return str(value)
        return {"object": f"{type(value).__module__}.{type(value).__qualname__}"}

    return {
        "args": [walk(a, 0) for a in args],
        "kwargs": {k: walk(v, 0) for k, v in sorted(kwargs.items())},
    }


def value_signature(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], dynamic: bool, float_values: bool = True
) -> tuple[Any, ...]:
    """The part of the input spec the kept guards do not check (Python values, containers'
    lengths, object types), as a cheap hashable tuple computed on every call: an entry serves a
    call only when both this signature and its guards match. Tensors are left to the guards."""
    if not kwargs:
        for a in args:
            if type(a) is not torch.Tensor:
                break
        else:  # plain tensors only (a serving call): what walk below gives, without its calls
            return (0,) * len(args)
    out: list[Any] = []

    def walk(value: Any, depth: int) -> None:
        if depth > _MAX_DEPTH:
            out.append("<too deep>")
        elif isinstance(value, torch.Tensor):
            out.append(0)
        elif value is None or isinstance(value, bool | str):
            out.append(value)
        elif isinstance(value, float):
            out.append(float if not (float_values or depth) and type(value) is float else value)
        elif isinstance(value, int):
            out.append("i" if dynamic and value not in (0, 1) else value)
        elif isinstance(value, list | tuple):
            out.append((type(value), len(value)))
            for v in value:
                walk(v, depth + 1)
        elif isinstance(value, Mapping):
            out.append((type(value), tuple(value)))
            for v in value.values():
                walk(v, depth + 1)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.append(type(value))
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), depth + 1)
        else:
            out.append(type(value))

    for a in args:
        walk(a, 0)
    for k in sorted(kwargs):
        out.append(k)
        walk(kwargs[k], 0)
    return tuple(out)


def package_version(distribution: str) -> str | None:
    """Installed version of a distribution without importing it (torch_npu imports CANN)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "npugraph_cache": __version__,
        "python": platform.python_version(),
        "python_impl": sys.implementation.name,
        "torch": torch.__version__,
        "torch_npu": package_version("torch_npu"),
        # global state dynamo guards on: separate entries instead of one entry recompiled back
        # and forth by processes that differ in it
        "num_threads": torch.get_num_threads(),
        "default_dtype": str(torch.get_default_dtype()),
    }


def rank_component(global_rank: int | None, tp_rank: int | None, pp_rank: int | None) -> str:
    """``world<W>global_rank<R>[_tp_rank<t>][_pp_rank<p>]`` when torch.distributed runs with more
    than one process (or a global_rank is given); empty for a single process."""
    world = 1
    rank = global_rank
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if rank is None and world > 1:
            rank = torch.distributed.get_rank()
    if rank is None:
        return ""
    part = f"world{world}global_rank{rank}"
    if tp_rank is not None:
        part += f"_tp_rank{tp_rank}"
    if pp_rank is not None:
        part += f"_pp_rank{pp_rank}"
    return part


def parameter_layouts(module: torch.nn.Module) -> str:
    """sha256 of every parameter's name, type, dtype, device, shape, stride and requires_grad:
    what torch's per-call TENSOR_MATCH on parameters checks, which a compiler that checks only
    their addresses drops (``parameter_guards=False``). The traced graph holds those layouts
    (``x.to(self.w.dtype)`` is traced as a no-op for an fp32 ``w``; a size is a constant) and
    the module's repr does not show them: ``model.double()`` or another parameter size gives
    another entry."""
    layouts = [
        (name, type(p).__qualname__, str(p.dtype), str(p.device), list(p.shape),
         list(p.stride()), p.requires_grad)
        for name, p in module.named_parameters(remove_duplicate=False)
    ]
    return _sha(json.dumps(layouts))


def model_info(module: torch.nn.Module, dynamic: bool) -> str:
    """``<Class>_<dynamic|static>_<digest of the module's repr>``: one folder per architecture."""
    return f"{type(module).__name__}_{'dynamic' if dynamic else 'static'}_{_sha(str(module))[:16]}"


@dataclasses.dataclass(frozen=True)
class CacheKey:
    fields: dict[str, Any]

    def digest(self) -> str:
        return _sha(json.dumps(self.fields, sort_keys=True, default=str))


def build_key(
    func: Callable[..., Any],
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    dynamic: bool,
    options: Mapping[str, Any] | None,
    custom_decompositions: Mapping[Any, Any] | None,
    rank: str,
    key_extra: Mapping[str, Any] | None = None,
    float_values: bool = True,
) -> CacheKey:
    """key_extra: what the caller's compiler adds (its versions, its options hash, its pass
    identities); JSON-able values."""
    fields: dict[str, Any] = {
        "environment": environment(),
        "func": getattr(func, "__qualname__", repr(func)),
        "func_source": source_digest(func),
        "forward_source": source_digest(type(module).forward),
        "module_class": f"{type(module).__module__}.{type(module).__qualname__}",
        "module_repr": _sha(str(module)),
        "parameters": parameter_layouts(module),
        "dynamic": dynamic,
        "options": options_digest(options),
        "custom_decompositions": decompositions_digest(custom_decompositions),
        "input_spec": input_spec(args, kwargs, dynamic, float_values),
        "rank": rank,
        "extra": stable_value(dict(key_extra or {})),
    }
    return CacheKey(fields)
