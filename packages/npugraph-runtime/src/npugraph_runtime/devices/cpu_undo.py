"""What a CPU capture overwrote in storages that existed before it, kept so that its writes can be
undone (a capture whose run is not the call's, a refused or failed capture, a capture ahead).

A write by ``index_put_`` (a KV cache written at a request's slot and position) keeps only the
elements it overwrites, gathered at its indices; any other write keeps a copy of the whole
storage, once. A server's KV buffer is many megabytes and a capture writes a few rows of it: the
whole copy, and its copy back, cost more than the rest of the capture's bookkeeping.

Undoing goes back in the reverse order of the writes: a whole copy taken after some rows were
written holds them, and the rows' own entries, undone after it, put back what was there before.
A storage copied whole needs no entry for its later writes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from npugraph_runtime.schema import overload_name
from npugraph_runtime.spans import non_overlapping

# the ops, not the methods: a None index is a dim not indexed (t[None] adds one; the
# index_put_ method refuses it)
_index = torch.ops.aten.index.Tensor
_index_put_ = torch.ops.aten.index_put_.default

# ops whose only write is ``self[indices] = values`` (accumulated or not), indices in args[1]
_INDEXED_WRITES = frozenset({"aten::index_put_", "aten::_index_put_impl_"})


@dataclass(frozen=True, slots=True)
class _Whole:
    storage: torch.UntypedStorage
    saved: torch.UntypedStorage

    def undo(self) -> None:
        self.storage.copy_(self.saved)


@dataclass(frozen=True, slots=True)
class _Elements:
    target: torch.Tensor  # an alias of the written tensor, its layout as at the write
    indices: tuple[torch.Tensor | None, ...]
    saved: torch.Tensor  # target[indices] before the write

    def undo(self) -> None:
        # elements a duplicate index names twice hold the same saved value: any order is right
        _index_put_(self.target, list(self.indices), self.saved)


class UndoLog:
    """The writes of one capture to pre-existing storages, in their order."""

    def __init__(self) -> None:
        self._entries: list[_Whole | _Elements] = []
        self._whole: set[int] = set()  # storages kept whole: their later writes need nothing
        self._written: dict[int, torch.UntypedStorage] = {}

    def before_write(self, t: torch.Tensor, func: Any, args: tuple[Any, ...]) -> None:
        """Keep what ``func(*args)`` is about to overwrite in ``t``, a tensor whose storage
        existed before the capture."""
        st = t.untyped_storage()
        key = id(st)
        if key in self._whole:
            return
        self._written[key] = st
        elements = self._elements(t, func, args)
        if elements is not None:
            self._entries.append(elements)
            return
        self._whole.add(key)
        self._entries.append(_Whole(st, st.clone()))  # type: ignore[no-untyped-call]

    @staticmethod
    def _elements(t: torch.Tensor, func: Any, args: tuple[Any, ...]) -> _Elements | None:
        if overload_name(func).split(".")[0] not in _INDEXED_WRITES or len(args) < 2:
            return None
        if args[0] is not t or not isinstance(args[1], list | tuple):
            return None
        if not all(i is None or isinstance(i, torch.Tensor) for i in args[1]):
            return None
        if not non_overlapping(t):
            return None  # the write refuses it (an expanded tensor); so would its undo
        written = t.untyped_storage().data_ptr()
        if any(i is not None and i.untyped_storage().data_ptr() == written for i in args[1]):
            return None  # indices read from the written storage: keep it whole
        # copies: a later op of the capture may write the index tensors
        indices = tuple(None if i is None else i.clone() for i in args[1])
        try:
            saved = _index(t, list(indices))
        except (IndexError, RuntimeError):  # the write itself will refuse these indices
            return None
        return _Elements(t.detach(), indices, saved)

    def undo(self) -> None:
        """Put back everything kept, the latest write first; once."""
        entries, self._entries = self._entries, []
        for entry in reversed(entries):
            entry.undo()
        self._whole.clear()
        self._written.clear()

    def kept_bytes(self) -> int:
        """The bytes kept to undo the writes so far."""
        return sum(e.saved.nbytes() if isinstance(e, _Whole) else e.saved.nbytes
                   for e in self._entries)

    def storages(self) -> list[torch.UntypedStorage]:
        """The storages written, in the order of their first write."""
        return list(self._written.values())
