"""The scratch outputs a kernel candidate writes while it is checked (cpu_candidates.verified).

During a capture they are views of one arena that grows to the largest check and lives until the
capture ends: a fresh tensor per check made the CPU map and fault in new pages for every one, and
that was most of what checking cost (273 of 376 ms over the continuous-batching bench's 8
captures). Captures are per thread (dispatch modes are), so each thread has its own arena; a
check made outside a capture gets fresh tensors."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from npugraph_runtime.spans import byte_span

_ALIGN = 64  # bytes: each scratch starts on a cache line, as a fresh allocation would


class _Arena(threading.local):
    def __init__(self) -> None:
        self.holders = 0
        self.storage: torch.UntypedStorage | None = None


_ARENA = _Arena()


def hold_scratch() -> None:
    """A capture begins on this thread: its checks share the arena until ``release_scratch``."""
    _ARENA.holders += 1


def release_scratch() -> None:
    """The capture ended: the arena's memory goes when no capture of this thread holds it."""
    _ARENA.holders = max(0, _ARENA.holders - 1)
    if _ARENA.holders == 0:
        _ARENA.storage = None


def scratch_held() -> bool:
    """A capture on this thread holds the arena (between ``hold_scratch`` and its release)."""
    return _ARENA.holders > 0


def arena_nbytes() -> int:
    """The bytes of scratch this thread's captures hold now (0 outside a capture)."""
    return 0 if _ARENA.storage is None else _ARENA.storage.nbytes()


def scratch_for(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per ``t`` with its layout, holding values that differ from ``t`` everywhere
    (so that a candidate that skips an element is caught), in disjoint memory."""
    if _ARENA.holders == 0:
        return [_fill(t, torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)) for t in ts]
    offsets, end = [], 0
    for t in ts:
        offsets.append(end)
        first, last = byte_span(t)
        end += -(-(last - first) // _ALIGN) * _ALIGN
    storage = _ARENA.storage
    if storage is None or storage.nbytes() < end:
        storage = _ARENA.storage = torch.UntypedStorage(max(end, _ALIGN))  # type: ignore[no-untyped-call]
    return [
        _fill(t, torch.empty(0, dtype=t.dtype).set_(storage, at // t.element_size(), t.size(), t.stride()))
        for t, at in zip(ts, offsets, strict=True)
    ]


def _fill(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool:
        torch.logical_not(t, out=s)
    elif t.is_floating_point() or t.is_complex():
        torch.neg(t, out=s)  # flips the sign bit of every element, zeros and NaNs included
    else:
        torch.bitwise_not(t, out=s)
    return s
