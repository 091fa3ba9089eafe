"""How each recorded op is re-issued at replay: the fastest callable that writes the op's result
into the recorded output storages, chosen and verified once, at capture time.

Candidates, fastest first: the public Python binding (``torch.add(..., out=)``, a bound in-place
``Tensor`` method), the ``.out`` overload's operator handle, and finally the op itself followed
by ``copy_`` into the recorded output (always correct). A candidate is kept only when it gives a
bitwise-identical result (same dtype, shape and strides) on the capture's own inputs, without
raising or warning."""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import torch

from npugraph_runtime import _compat


class Kind(enum.Enum):
    SKIP = "skip"  # views, allocations, ops with no tensor result: nothing to do at replay
    OUT_PUBLIC = "out_public"  # binding(*args, out=outs)
    OUT_OVERLOAD = "out_overload"  # overload_out._op(*args, out0=..., ...)
    COPY = "copy"  # out.copy_(op(*args))
    INPLACE_METHOD = "inplace_method"  # self.method(*args[1:])
    AS_IS = "as_is"  # op(*args) re-issued unchanged (mutating ops), fresh results copied
    COLLECTIVE = "collective"  # r = op(*args); wait_tensor(r); out.copy_(r)
    FROZEN = "frozen"  # unsafe op under "relaxed": copy the captured values back


_ALLOCATIONS = frozenset(
    {
        "aten::empty.memory_format",
        "aten::empty_strided",
        "aten::empty_like",
        "aten::new_empty",
        "aten::new_empty_strided",
    }
)


def overload_name(func: Any) -> str:
    schema = func._schema
    return f"{schema.name}.{schema.overload_name}" if schema.overload_name else str(schema.name)


def is_allocation(func: Any) -> bool:
    return overload_name(func) in _ALLOCATIONS


def write_positions(func: Any) -> tuple[list[int], list[str]]:
    """Positional indices and keyword names of the arguments the op writes (``Tensor(a!)``)."""
    positions: list[int] = []
    names: list[str] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            if arg.kwarg_only:
                names.append(arg.name)
            else:
                positions.append(i)
    return positions, names


def fresh_returns(func: Any) -> list[bool]:
    return [r.alias_info is None for r in func._schema.returns]


def single_tensor_returns(func: Any) -> bool:
    return all(str(r.type) == "Tensor" for r in func._schema.returns) and len(func._schema.returns) > 0


@cache
def public_binding(namespace: str, name: str) -> Callable[..., Any] | None:
    if namespace != "aten":
        return None
    for module in _compat.public_op_namespaces():
        fn = getattr(module, name, None)
        if fn is not None:
            return fn  # type: ignore[no-any-return]
    return None


@cache
def _out_overload_of(func: Any) -> tuple[Callable[..., Any], tuple[str, ...]] | None:
    schema = func._schema
    want = [(a.name, str(a.type)) for a in schema.arguments]
    packet = func.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        cs = candidate._schema
        outs = [a for a in cs.arguments if a.alias_info is not None and a.alias_info.is_write]
        rest = [
            (a.name, str(a.type))
            for a in cs.arguments
            if a.alias_info is None or not a.alias_info.is_write
        ]
        if (
            outs
            and all(a.kwarg_only for a in outs)
            and len(outs) == len(schema.returns)
            and rest == want
        ):
            return _compat.op_entry(candidate), tuple(a.name for a in outs)
    return None


def out_overload(func: Any) -> tuple[Callable[..., Any], tuple[str, ...]] | None:
    try:
        return _out_overload_of(func)
    except Exception:  # an op whose schema we cannot read: fall back to compute-and-copy
        return None


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_result(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (NaN-aware) with the same dtype, shape and strides."""
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    if a.numel() == 0:
        return True
    int_dtype = _INT_OF_SIZE.get(a.element_size())
    if (
        int_dtype is not None
        and not a.is_complex()
        and torch.equal(a.view(int_dtype), b.view(int_dtype))
    ):
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))
    return torch.equal(a, b)


def scratch_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor with ``t``'s layout holding values that differ from ``t`` everywhere, so a candidate
    that skips an element is caught."""
    s = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
    s.copy_(t)
    if t.dtype == torch.bool:
        s.logical_not_()
    elif t.is_floating_point() or t.is_complex():
        s.neg_()  # flips the sign bit of every element, zeros and NaNs included
    else:
        s.bitwise_not_()
    return s


def _quietly(fn: Callable[[], object]) -> bool:
    """Run ``fn``; False if it raised or warned."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except Exception:
            return False
    return not caught


def choose_out_kernel(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any], outs: Sequence[torch.Tensor]
) -> tuple[Kind, Callable[..., Any] | None, tuple[str, ...]]:
    """For a functional op whose returns are fresh tensors ``outs`` (just computed from ``args``)."""
    if not single_tensor_returns(func) or any(o.layout != torch.strided for o in outs):
        return Kind.COPY, None, ()
    binding = public_binding(func.namespace, func._opname)
    if binding is not None:
        scratch = [scratch_like(o) for o in outs]
        out_arg: Any = scratch[0] if len(scratch) == 1 else tuple(scratch)
        if _quietly(lambda: binding(*args, **kwargs, out=out_arg)) and all(
            same_result(s, o) for s, o in zip(scratch, outs, strict=True)
        ):
            return Kind.OUT_PUBLIC, binding, ()
    found = out_overload(func)
    if found is not None:
        entry, names = found
        scratch = [scratch_like(o) for o in outs]
        out_kwargs = dict(zip(names, scratch, strict=True))
        if _quietly(lambda: entry(*args, **kwargs, **out_kwargs)) and all(
            same_result(s, o) for s, o in zip(scratch, outs, strict=True)
        ):
            return Kind.OUT_OVERLOAD, entry, names
    return Kind.COPY, None, ()


def inplace_method_name(func: Any, args: Sequence[Any]) -> str | None:
    """The ``Tensor`` method for an op that only writes its first argument and returns it."""
    positions, names = write_positions(func)
    returns = func._schema.returns
    if positions != [0] or names or len(returns) != 1 or not args:
        return None
    if not isinstance(args[0], torch.Tensor) or args[0].layout != torch.strided:
        return None
    name = func._opname
    if func.namespace != "aten" or not name.endswith("_") or not hasattr(torch.Tensor, name):
        return None
    return str(name)


def verify_inplace_method(
    name: str, before: torch.Tensor, after: torch.Tensor, args: Sequence[Any], kwargs: dict[str, Any]
) -> bool:
    """Replay the method on ``before`` (a copy of the first argument taken before the op ran) and
    compare with what the op left in ``after``."""
    method = getattr(before, name)
    return _quietly(lambda: method(*args[1:], **kwargs)) and same_result(before, after)
