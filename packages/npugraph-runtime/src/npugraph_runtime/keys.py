"""Graph keys and argument pickers, built once per callable from its InputSpec.

A graph key is a tuple of ints: the values of the symbolic int inputs, then for each keyed tensor
its rank and sizes (every dim keyed) or the sizes of its keyed dims. When nothing is keyed the
key is the constant ``()`` and no key function exists at all."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import itemgetter

import torch

from npugraph_runtime.spec import InputSpec, SlotKind

Args = tuple[object, ...]
Key = tuple[int, ...]

_KEYED_TENSORS = (SlotKind.USER, SlotKind.MUTATED)


def picker(indices: Sequence[int]) -> Callable[[Args], tuple[object, ...]] | None:
    """``args -> tuple(args[i] for i in indices)`` at C speed; None when there is nothing to pick."""
    if not indices:
        return None
    first = indices[0]
    if list(indices) == list(range(first, first + len(indices))):
        return itemgetter(slice(first, first + len(indices)))  # a slice is 5x cheaper than a gather
    return itemgetter(*indices)


def key_function(spec: InputSpec) -> Callable[[Args], Key] | None:
    """The key of a call, or None when every call has the key ``()``."""
    symbolic = tuple(i for i, k in enumerate(spec.kinds) if k is SlotKind.SYMBOLIC)
    whole: list[int] = []
    dims: list[tuple[int, int]] = []
    for i, kind in enumerate(spec.kinds):
        if kind in _KEYED_TENSORS:
            keyed = spec.dims_keyed(i)
            if keyed is None:
                whole.append(i)
            else:
                dims.extend((i, d) for d in keyed)
    if not whole and not dims:
        if not symbolic:
            return None
        pick = picker(symbolic)
        assert pick is not None
        return pick  # type: ignore[return-value]  # symbolic slots hold ints

    def key(args: Args) -> Key:
        k: list[int] = [args[i] for i in symbolic]  # type: ignore[misc]
        for i in whole:
            shape = args[i].shape  # type: ignore[attr-defined]
            k.append(len(shape))
            k += shape
        for i, d in dims:
            k.append(args[i].shape[d])  # type: ignore[attr-defined]
        return tuple(k)

    return key


def data_ptrs(tensors: Sequence[object]) -> list[int]:
    return list(map(torch.Tensor.data_ptr, tensors))  # type: ignore[arg-type]
