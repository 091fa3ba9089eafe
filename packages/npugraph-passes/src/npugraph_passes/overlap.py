"""Whether the elements of a strided tensor may share memory with each other.

A write into a tensor whose distinct elements share memory (``expand``, ``unfold`` with a step
smaller than the window, ``as_strided`` with small strides) is not the functional result: a later
element's write clobbers an earlier one's, and an elementwise op may read what it already wrote.
The re-inplacing passes ask :func:`may_self_overlap` before writing into a tensor.

The test is the mixed-radix argument: order the dimensions by stride; if every stride is larger
than the span (``stride * (size - 1)`` summed) of all smaller-stride dimensions, distinct indices
give distinct offsets. It is sufficient, not necessary (interleaved layouts that do not overlap
are reported as overlapping), which only costs a missed rewrite. Symbolic sizes and strides are
compared with guard-free checks; whatever cannot be decided counts as overlapping.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from npugraph_passes import _compat


def _known(x: Any) -> bool:
    return x is True or (not isinstance(x, bool) and _compat.statically_known_true(x))


def _by_stride(strides: Sequence[Any]) -> Callable[[int, int], int]:
    def compare(a: int, b: int) -> int:
        if _known(strides[a] < strides[b]):
            return -1
        if _known(strides[b] < strides[a]):
            return 1
        return b - a  # undecided (or equal): the later dimension first, as in row-major
    return compare


def _orders(sizes: Sequence[Any], strides: Sequence[Any]) -> list[list[int]]:
    """Candidate innermost-first dimension orders: the row-major order (last dimension
    innermost, the layout of most views) and the order of the strides as far as it is known.
    Any order is only a candidate: :func:`_injective` proves or rejects it."""
    dims = list(range(len(sizes)))
    orders = [dims[::-1]]
    by_stride = sorted(dims, key=functools.cmp_to_key(_by_stride(strides)))
    if by_stride != orders[0]:
        orders.append(by_stride)
    return orders


def _injective(order: list[int], sizes: Sequence[Any], strides: Sequence[Any]) -> bool:
    span: Any = 0  # largest offset reachable with the dimensions seen so far
    for d in order:
        size, stride = sizes[d], strides[d]
        if _known(size == 1):
            continue
        if not _known(stride >= span + 1):
            return False
        span = span + stride * (size - 1)
    return True


def may_self_overlap(t: torch.Tensor) -> bool:
    """True unless ``t``'s distinct elements are known to occupy distinct memory."""
    sizes, strides = tuple(t.shape), tuple(t.stride())
    if any(_known(s == 0) for s in sizes):
        return False  # no elements
    return not any(_injective(order, sizes, strides) for order in _orders(sizes, strides))
