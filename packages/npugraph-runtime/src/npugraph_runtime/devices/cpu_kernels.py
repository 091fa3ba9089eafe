"""How each recorded op is re-issued at replay, decided once, at capture time.

For a functional op the candidates are: the public Python binding with ``out=``
(``torch.add(a, b, out=c)``), the ``.out`` overload's operator handle, and computing the result
(with the public binding or the op itself) then ``copy_`` into the recorded output. A candidate
is kept only when, on the capture's own inputs, it gives a bitwise-identical result (NaN-aware;
same dtype, shape and strides) without raising or warning; each kept one is timed, and the replay
uses the cheapest given which outputs later ops actually read. The op itself followed by a copy
is always available. In-place ops are re-issued as a bound ``Tensor`` method when that verifies,
else as the op itself."""

from __future__ import annotations

import enum
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache, partial
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
    COLLECTIVE = "collective"  # c = op(*args), waited and copied into place at its wait
    COLLECTIVE_WAIT = "collective_wait"  # wait_tensor where the graph waits (cpu_collectives)
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
    schema = _compat.op_schema(func)
    return f"{schema.name}.{schema.overload_name}" if schema.overload_name else str(schema.name)


def is_allocation(func: Any) -> bool:
    return overload_name(func) in _ALLOCATIONS


@cache
def write_positions(func: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Positional indices and keyword names of the arguments the op writes (``Tensor(a!)``).
    Cached: it is asked for every op of every capture."""
    positions: list[int] = []
    names: list[str] = []
    for i, arg in enumerate(_compat.op_schema(func).arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            if arg.kwarg_only:
                names.append(arg.name)
            else:
                positions.append(i)
    return tuple(positions), tuple(names)


def single_tensor_returns(func: Any) -> bool:
    returns = _compat.op_schema(func).returns
    return len(returns) > 0 and all(str(r.type) == "Tensor" for r in returns)


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
    schema = _compat.op_schema(func)
    want = [(a.name, str(a.type)) for a in schema.arguments]
    packet = func.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        cs = _compat.op_schema(candidate)
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


@dataclass(frozen=True)
class Candidate:
    """One verified way to re-issue a functional op, and what one call cost at capture time.
    COPY candidates return the result; the replay copies the outputs it needs into place."""

    kind: Kind
    call: Callable[..., Any]
    out_names: tuple[str, ...] = ()
    cost_ns: int = 0


_SLOW_NS = 200_000  # one call this slow is timed once: capture of big models stays quick


def _cost_ns(fn: Callable[[], object]) -> int:
    best = None
    for _ in range(3):
        start = time.perf_counter_ns()
        fn()
        elapsed = time.perf_counter_ns() - start
        best = elapsed if best is None else min(best, elapsed)
        if best > _SLOW_NS:
            break
    return best or 0


def _leaf(value: Any, path: tuple[int, ...]) -> Any:
    for i in path:
        value = value[i]
    return value


Outs = Sequence[tuple[tuple[int, ...], torch.Tensor]]


def _runner(
    c: Candidate, args: Sequence[Any], kwargs: dict[str, Any], outs: Outs
) -> tuple[Callable[[], Any], list[torch.Tensor]]:
    """A zero-argument call of ``c`` on ``args``, and the scratch outputs it writes (out= kinds)."""
    if c.kind is Kind.COPY:
        return partial(c.call, *args, **kwargs), []
    scratch = [scratch_like(t) for _, t in outs]
    if c.kind is Kind.OUT_PUBLIC:
        out_arg: Any = scratch[0] if len(scratch) == 1 else tuple(scratch)
        return partial(c.call, *args, **kwargs, out=out_arg), scratch
    return partial(c.call, *args, **kwargs, **dict(zip(c.out_names, scratch, strict=True))), scratch


def _verified(c: Candidate, args: Sequence[Any], kwargs: dict[str, Any], outs: Outs) -> bool:
    run, scratch = _runner(c, args, kwargs, outs)
    result: list[Any] = []
    if not _quietly(lambda: result.append(run())):
        return False
    if c.kind is Kind.COPY:
        return all(
            isinstance(got := _leaf(result[0], p), torch.Tensor) and same_result(got, t)
            for p, t in outs
        )
    return all(same_result(s, t) for s, (_, t) in zip(scratch, outs, strict=True))


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.dtype, tuple(value.shape), value.stride(), value.layout, value.device)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _signature(v)) for k, v in value.items()))
    return (type(value), value)


# Timings by (op, argument layouts and constants): a model's repeated layers are timed once. Every
# capture still verifies each candidate on its own data; only the timing is reused.
_MEASURED: dict[Any, tuple[tuple[Candidate, ...], tuple[int, ...]]] = {}
_MEASURED_MAX = 4096


def out_candidates(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any], outs: Outs
) -> tuple[list[Candidate], list[int]]:
    """The verified candidates for a functional op whose fresh results ``outs`` (path into the
    result, tensor) were just computed from ``args``, and the cost of copying each output."""
    op = _compat.op_entry(func)
    if func.namespace not in ("aten", "prims"):
        # a custom op may have effects its schema does not show: run it once per replay, never
        # again at capture to time it
        return [Candidate(Kind.COPY, op)], [0] * len(outs)
    key: Any = (func, _signature(args), _signature(kwargs))
    try:
        measured = _MEASURED.get(key)
    except TypeError:  # an unhashable constant: measure every time
        key, measured = None, None
    if measured is not None:
        candidates, copy_costs = measured
        found = [c for c in candidates if c.call is op or _verified(c, args, kwargs, outs)]
        return found, list(copy_costs)

    possible = [Candidate(Kind.COPY, op)]
    binding = public_binding(func.namespace, _compat.op_base_name(func))
    if binding is not None:
        possible.append(Candidate(Kind.COPY, binding))
    # out= kernels take one buffer per return: only when every return is a tensor produced here
    # (an undefined optional result, e.g. mkldnn_rnn_layer's workspace, is None)
    if (
        single_tensor_returns(func)
        and len(outs) == len(_compat.op_schema(func).returns)
        and all(t.layout == torch.strided for _, t in outs)
    ):
        if binding is not None:
            possible.append(Candidate(Kind.OUT_PUBLIC, binding))
        overload = out_overload(func)
        if overload is not None:
            possible.append(Candidate(Kind.OUT_OVERLOAD, overload[0], overload[1]))
    found = []
    for c in possible:
        # the op itself is the reference: it needs no check
        if c.call is op or _verified(c, args, kwargs, outs):
            run, _ = _runner(c, args, kwargs, outs)
            found.append(replace(c, cost_ns=_cost_ns(run)))
    costs = [_cost_ns(partial(scratch_like(t).copy_, t)) for _, t in outs]
    if key is not None:
        if len(_MEASURED) >= _MEASURED_MAX:
            _MEASURED.clear()
        _MEASURED[key] = (tuple(found), tuple(costs))
    return found, costs


def cheapest(candidates: Sequence[Candidate], copy_costs: Sequence[int], needed: Sequence[bool]) -> Candidate:
    """The candidate with the lowest cost when only the ``needed`` outputs are copied."""
    copies = sum(c for c, n in zip(copy_costs, needed, strict=True) if n)
    return min(candidates, key=lambda c: c.cost_ns + (copies if c.kind is Kind.COPY else 0))


def inplace_method_name(func: Any, args: Sequence[Any]) -> str | None:
    """The ``Tensor`` method for an op that only writes its first argument and returns it."""
    positions, names = write_positions(func)
    returns = _compat.op_schema(func).returns
    if positions != (0,) or names or len(returns) != 1 or not args:
        return None
    if not isinstance(args[0], torch.Tensor) or args[0].layout != torch.strided:
        return None
    name = _compat.op_base_name(func)
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
