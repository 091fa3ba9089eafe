"""What the recorder reads of an op: the facts its schema and tags alone decide (cached per op),
and why an op cannot be re-issued by a replay (an unsafe tag or name, a copy between devices),
with the argument values that make a tagged op safe after all."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from npugraph_runtime import _compat
from npugraph_runtime.devices.cpu_candidates import is_allocation
from npugraph_runtime.devices.cpu_collectives import is_wait
from npugraph_runtime.devices.cpu_record import tensors_of
from npugraph_runtime.devices.cpu_streams import is_event_marker, replays_marker
from npugraph_runtime.schema import overload_name, write_positions

_UNSAFE_TAGS: tuple[tuple[str, str], ...] = (
    ("data_dependent_output", "reads a tensor's value on the host (a host synchronisation)"),
    ("dynamic_output_shape", "has an output shape that depends on the data"),
    ("nondeterministic_seeded", "draws random numbers, which a replay would not redraw"),
    ("cudagraph_unsafe", "is marked unsafe for device-graph capture"),
)
_UNSAFE_NAMES = {
    "aten::is_nonzero": "reads a tensor's value on the host (a host synchronisation)",
    "aten::set_.source_Storage": "swaps a tensor's storage",
    "aten::set_.source_Storage_storage_offset": "swaps a tensor's storage",
    "aten::set_.source_Tensor": "swaps a tensor's storage",
    "aten::set_": "swaps a tensor's storage",
}
_TRUSTED_SCHEMAS = frozenset({"aten", "prims", "_c10d_functional", "npugraph_ex"})
_COPY_OPS = frozenset({"aten::_to_copy", "aten::copy_", "aten::to.device", "aten::_copy_from"})


@dataclass(frozen=True, slots=True)
class OpInfo:
    """What the recorder asks of an op on every call that its schema and tags alone decide."""

    name: str  # overload_name
    unsafe_tags: tuple[tuple[str, str], ...]  # its tags of _UNSAFE_TAGS, in that order
    named_reason: str | None  # _UNSAFE_NAMES
    copies: bool  # one of _COPY_OPS: unsafe when it copies between devices
    writes: tuple[tuple[int, ...], tuple[str, ...]]  # write_positions
    trusted_schema: bool  # its namespace declares what it writes
    metadata_only: bool  # an in-place view op
    wait: bool  # a collective's wait
    functional_collective: bool  # a _c10d_functional op
    event_marker: bool  # a graph-event op: program order orders a replay, so it is left out
    marker: bool  # a scope op a replay runs again
    allocation: bool


@cache
def op_info(func: Any) -> OpInfo:
    name = overload_name(func)
    tags = func.tags
    unsafe_tags = tuple(
        (tag_name, why) for tag_name, why in _UNSAFE_TAGS
        if (tag := getattr(torch.Tag, tag_name, None)) is not None and tag in tags
    )
    return OpInfo(
        name,
        unsafe_tags,
        _UNSAFE_NAMES.get(name),
        str(_compat.op_schema(func).name) in _COPY_OPS or name in _COPY_OPS,
        write_positions(func),
        func.namespace in _TRUSTED_SCHEMAS,
        torch.Tag.inplace_view in tags,
        is_wait(func),
        func.namespace == "_c10d_functional",
        is_event_marker(func),
        replays_marker(func),
        is_allocation(func),
    )


def _argument(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    for i, arg in enumerate(_compat.op_schema(func).arguments):
        if arg.name == name:
            if i < len(args) and not arg.kwarg_only:
                return args[i]
            return kwargs.get(name, arg.default_value if arg.has_default_value() else None)
    return None


def _draws_nothing(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Ops tagged as seeded that draw no random number with these arguments: attention and
    dropout with probability 0 (SDPA kernels carry the tag for their dropout) or not training."""
    names = {a.name for a in _compat.op_schema(func).arguments}
    for p_name in ("dropout_p", "p"):
        if p_name in names and _argument(func, args, kwargs, p_name) == 0:
            return True
    return "train" in names and _argument(func, args, kwargs, "train") is False


def _shape_fixed_here(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Ops tagged as having a data-dependent output shape whose shape is fixed by these
    arguments: indexing with integer index tensors (only boolean masks make it data-dependent)."""
    if overload_name(func) != "aten::index.Tensor":
        return False
    indices = _argument(func, args, kwargs, "indices") or ()
    return all(
        i is None or (isinstance(i, torch.Tensor) and i.dtype not in (torch.bool, torch.uint8))
        for i in indices
    )


def unsafe_reason(
    info: OpInfo, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    for tag_name, why in info.unsafe_tags:
        if tag_name == "nondeterministic_seeded" and _draws_nothing(func, args, kwargs):
            continue
        if tag_name == "dynamic_output_shape" and _shape_fixed_here(func, args, kwargs):
            continue
        return why
    if info.named_reason is not None:
        return info.named_reason
    if info.copies:
        devices = {t.device for t in tensors_of((args, tuple(kwargs.values())))}
        target = kwargs.get("device")
        if target is not None:
            devices.add(torch.device(target))
        if len(devices) > 1:
            return "copies between devices (" + ", ".join(sorted(map(str, devices))) + ")"
    return None
