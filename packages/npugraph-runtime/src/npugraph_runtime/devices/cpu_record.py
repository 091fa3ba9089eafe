"""What a CPU recording holds: the recorded tensors and storages, the steps a replay issues, and
the walks over an op's (nested) arguments and results that build them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from npugraph_runtime.devices.cpu_candidates import Candidate, Kind
from npugraph_runtime.devices.cpu_streams import CpuStream

CPU = torch.device("cpu")


class TRef:
    """A recorded tensor, by its index in ``Recorder.tensors``."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


@dataclass(slots=True, eq=False)
class TensorEntry:
    obj: torch.Tensor | None
    storage: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(slots=True, eq=False)
class StorageEntry:
    obj: torch.UntypedStorage | None
    produced: bool  # first seen as the output of a recorded op
    first: int
    last: int
    nbytes: int
    pinned: bool = False  # never pooled, never dropped (frozen results, unusual layouts)


@dataclass(slots=True, eq=False)
class Step:
    func: Any
    kind: Kind
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    outs: tuple[tuple[tuple[int, ...], TRef], ...] = ()  # (path into the result, tensor)
    call: Any = None
    out_names: tuple[str, ...] = ()
    method: str = ""
    saved: tuple[tuple[TRef, torch.Tensor], ...] = ()  # FROZEN: values to copy back
    candidates: list[Candidate] = field(default_factory=list)  # verified ways to re-issue it
    stream: CpuStream | None = None  # the logical stream the op was issued on


def leaves_of(value: Any, path: tuple[int, ...] = ()) -> Iterator[tuple[tuple[int, ...], Any]]:
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from leaves_of(v, (*path, i))
    else:
        yield path, value


def tensors_of(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_of(v)


def tensor_list(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among an op's arguments, nested lists included, in order."""
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += tensors_of(value)
    return found



def is_plain(t: torch.Tensor) -> bool:
    return (
        t.layout == torch.strided
        and not t.is_conj()
        and not t.is_neg()
        and not t.is_quantized
        and t.device == CPU
    )


def exact_copy(t: torch.Tensor) -> torch.Tensor:
    c = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
    c.copy_(t)
    return c
