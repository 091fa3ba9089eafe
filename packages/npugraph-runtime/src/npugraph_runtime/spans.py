"""The bytes a tensor may touch, for overlap tests between views of one storage (user inputs cut
from one arena; the CPU pool's intermediates, which all share one storage), and whether a tensor's
own elements overlap. A leaf below devices/: it imports only torch."""

from __future__ import annotations

import torch

__all__ = ["byte_span", "bytes_overlap", "non_overlapping"]


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` may touch, [first, last + 1) (empty for no elements)."""
    if t.numel() == 0:
        return 0, 0
    start = t.data_ptr()
    reach = sum((n - 1) * d for n, d in zip(t.shape, t.stride(), strict=True))
    return start, start + (reach + 1) * t.element_size()


def bytes_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The byte ranges ``a`` and ``b`` may touch intersect (disjoint views of one storage, e.g.
    a cache and a scratch input cut from one arena, do not)."""
    (a_lo, a_hi), (b_lo, b_hi) = byte_span(a), byte_span(b)
    return a_lo < b_hi and b_lo < a_hi


def non_overlapping(t: torch.Tensor) -> bool:
    """No two elements of ``t`` share memory (an expanded or as_strided view may fail this):
    only then can ``t`` be written element by element, as a copy into a buffer does."""
    reach = 0  # the furthest element offset the dims already walked can reach
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride(), strict=True) if s > 1),
                               key=lambda d: d[1]):
        if stride <= reach:
            return False
        reach += (size - 1) * stride
    return True
