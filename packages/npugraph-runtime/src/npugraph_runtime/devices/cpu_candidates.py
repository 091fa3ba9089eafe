"""Replay-kernel candidates for one recorded op: the kinds of step a replay issues, the ways a
functional op can be re-issued (``Candidate``, in ``RULE`` order) and the bitwise check of a
candidate's result on the capture's own data; in-place ops' ``Tensor`` methods and their check
(by dispatch).
cpu_kernels.py decides, per op signature, which candidate a replay uses."""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import torch

from npugraph_runtime import _compat
from npugraph_runtime._compat import TorchDispatchMode
from npugraph_runtime.devices.cpu_scratch import scratch_for
from npugraph_runtime.schema import overload_name, write_positions


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
    COPY_INTO = "copy_into"  # out.copy_(source(args)): the op's result is a copy of one input


_ALLOCATIONS = frozenset(
    {
        "aten::empty.memory_format",
        "aten::empty_strided",
        "aten::empty_like",
        "aten::new_empty",
        "aten::new_empty_strided",
    }
)


def is_allocation(func: Any) -> bool:
    return overload_name(func) in _ALLOCATIONS


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


def _quietly(fn: Callable[[], object]) -> bool:
    """Run ``fn``; False if it raised or warned."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except Exception:
            return False
    return not caught


# The order in which verified candidates are preferred, by label (see the module docstring).
RULE = ("copy_into", "gather_rows", "out_public", "out_overload", "binding", "op")


def gathers_rows(func: Any, args: Sequence[Any]) -> bool:
    """``func(*args)`` is ``x[idx]``: aten.index with one 1-D integer index, on dim 0."""
    if overload_name(func) != "aten::index.Tensor" or len(args) != 2:
        return False
    indices = args[1]
    if not isinstance(indices, list | tuple) or len(indices) != 1:
        return False
    idx = indices[0]
    return (isinstance(idx, torch.Tensor) and idx.dim() == 1
            and idx.dtype in (torch.int64, torch.int32) and isinstance(args[0], torch.Tensor)
            and args[0].dim() >= 1)


_index_out = torch.ops.aten.index.Tensor_out


def gather_rows(x: torch.Tensor, indices: Sequence[torch.Tensor], *, out: torch.Tensor) -> None:
    """``x[idx]`` into ``out`` as ``index_select`` (a copy per row, 2-3x faster on the CPU than
    aten.index's per-element copy, the same values); an index ``index_select`` refuses (a negative
    one, which ``x[idx]`` wraps, or one out of range, which ``x[idx]`` refuses too) is left to
    aten.index, which writes every element of ``out`` again."""
    try:
        torch.index_select(x, 0, indices[0], out=out)
    except (IndexError, RuntimeError):
        _index_out(x, list(indices), out=out)


@dataclass(frozen=True)
class Candidate:
    """One way to re-issue a functional op. COPY candidates return the result; the replay copies
    the outputs it needs into place. COPY_INTO: ``call(args)`` is the input whose copy the result
    is. ``label`` names the candidate in exported decisions and places it in ``RULE``."""

    kind: Kind
    call: Callable[..., Any]
    out_names: tuple[str, ...] = ()
    label: str = ""

    @property
    def rank(self) -> int:
        return RULE.index(self.label) if self.label in RULE else len(RULE)


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
    scratch = scratch_for([t for _, t in outs])
    if c.kind is Kind.COPY_INTO:
        return partial(scratch[0].copy_, c.call(args)), scratch
    if c.kind is Kind.OUT_PUBLIC:
        out_arg: Any = scratch[0] if len(scratch) == 1 else tuple(scratch)
        return partial(c.call, *args, **kwargs, out=out_arg), scratch
    return partial(c.call, *args, **kwargs, **dict(zip(c.out_names, scratch, strict=True))), scratch


def verified(c: Candidate, args: Sequence[Any], kwargs: dict[str, Any], outs: Outs) -> bool:
    """Whether ``c`` gives the op's results bitwise on this capture's data."""
    if c.label == "op":  # the op itself is the reference: it needs no check
        return True
    run, scratch = _runner(c, args, kwargs, outs)
    result: list[Any] = []
    if not _quietly(lambda: result.append(run())):
        return False
    if c.kind is Kind.COPY:
        ok = all(
            isinstance(got := _leaf(result[0], p), torch.Tensor) and same_result(got, t)
            for p, t in outs
        )
    else:
        ok = all(same_result(s, t) for s, (_, t) in zip(scratch, outs, strict=True))
    return ok


def preferred(candidates: Sequence[Candidate]) -> Candidate:
    """The verified candidate the replay issues: the first by ``RULE``."""
    return min(candidates, key=lambda c: c.rank)


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


class _Dispatched(Exception):
    """Raised by ``_FirstDispatch`` to stop the call it intercepted before anything runs."""


class _FirstDispatch(TorchDispatchMode):  # type: ignore[misc]
    """Notes the first op a call dispatches and stops the call there, running nothing."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.seen = (func, args, kwargs or {})
        raise _Dispatched


def _same_arguments(a: Any, b: Any) -> bool:
    """The same tensors (objects) and equal constants, of the same types, in the same structure."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(map(_same_arguments, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_arguments(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # a constant that does not compare (an ambiguous truth value)
        return False


def dispatches_as(name: str, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether ``args[0].<name>(*args[1:], **kwargs)``, the ``Tensor`` method a replay would
    issue, reaches ``func`` with these very arguments: then it is the op itself, whatever the
    data. Checked by dispatch alone, running nothing: no copy of the (possibly large) tensor
    written, and no check that passes by coincidence on the capture's values."""
    mode = _FirstDispatch()
    try:
        with mode:
            getattr(args[0], name)(*args[1:], **kwargs)
    except _Dispatched:
        pass
    except Exception:  # the method refuses these arguments: the op is re-issued as it is
        return False
    if mode.seen is None:
        return False
    seen_func, seen_args, seen_kwargs = mode.seen
    return (seen_func is func and _same_arguments(seen_args, tuple(args))
            and _same_arguments(seen_kwargs, dict(kwargs)))
