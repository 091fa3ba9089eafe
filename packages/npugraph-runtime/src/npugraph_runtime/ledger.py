"""The output ledger: one per pool, it tells whether anything outside the captures still holds a
static output, so that a replay never overwrites a value the caller kept.

For each static output storage the ledger has a weak reference to the storage and, through the
``OutputWatch`` of every capture that hands it out, the references the captures themselves own:
to the tensor objects returned, to the container tuple, to the storage's Python object, and the
C++ uses of the storage. "Held" means any count above what the captures own. Three ways a caller
keeps an output are seen, each by one C-level counter:

* the tensor object returned (its refcount; the storage's use count does not move),
* a view of it (the storage's use count: the view is another TensorImpl),
* only ``out.untyped_storage()``: torch hands back the storage's one Python object, which the
  watch holds, so only that object's refcount moves.

A capture that keeps another capture's output as its own input (graph B updating graph A's
result in place across a graph break) owns references too: ``OutputLedger.owned_by_capture``
adds them to what the captures own, and the returned undo takes them back when B goes.

The ledger also knows the tensors a call returned that no replay overwrites (a warmup's result,
a capture's own run): under ``clone_input=False`` such a tensor fed to a later graph must not
become that graph's buffer (``is_result``)."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from npugraph_runtime import _compat
from npugraph_runtime.inputs import storage_ptr


class OutputWatch:
    """What one capture's replay closure compares: the objects a caller may keep (``objects``:
    returned tensors, the returned tuple, the storages' Python objects) and the storages' C++
    handles (``cdatas``), with the counts the captures own (``base``)."""

    __slots__ = ("__weakref__", "base", "cdatas", "objects", "use_count")

    def __init__(self, objects: list[object], cdatas: list[int]) -> None:
        self.objects = objects
        self.cdatas = cdatas
        self.use_count = _compat.storage_use_count()
        self.base: tuple[list[int], list[int]] = ([], [])

    def counts(self) -> tuple[list[int], list[int]]:
        return list(map(sys.getrefcount, self.objects)), list(map(self.use_count, self.cdatas))

    def settle(self) -> None:
        """Nothing outside the captures holds these outputs now: what is counted is owned."""
        self.base = self.counts()

    def held(self) -> bool:
        return self.counts() != self.base

    def places(self, t: torch.Tensor, storage: torch.UntypedStorage) -> tuple[int | None, int | None, int | None]:
        """Where ``t``, its storage's Python object and its storage's uses are counted here."""
        at_tensor = next((k for k, o in enumerate(self.objects) if o is t), None)
        at_storage = next((k for k, o in enumerate(self.objects) if o is storage), None)
        at_uses = self.cdatas.index(storage._cdata) if storage._cdata in self.cdatas else None
        return at_tensor, at_storage, at_uses

    def shift(self, places: tuple[int | None, int | None, int | None],
              counts: tuple[int, int, int]) -> None:
        counted, used = self.base
        at_tensor, at_storage, at_uses = places
        refs, storage_refs, uses = counts
        if at_tensor is not None and at_tensor < len(counted):
            counted[at_tensor] += refs
        if at_storage is not None and at_storage < len(counted):
            counted[at_storage] += storage_refs
        if at_uses is not None and at_uses < len(used):
            used[at_uses] += uses


class _Entry:
    """One static output storage: a weak reference to it and the watches that count it."""

    __slots__ = ("storage", "watches")

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = _compat.storage_weak_ref(storage)
        self.watches: list[weakref.ref[OutputWatch]] = []


class OutputLedger:
    """The static output storages of one pool's captures, and the tensors its callable returned
    that no replay overwrites."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._returned: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        _LEDGERS.add(self)

    def watch(self, tensors: Sequence[torch.Tensor], container: object | None) -> OutputWatch | None:
        """The watch of a capture that hands ``tensors`` (static outputs) to its caller, and
        ``container`` (the returned tuple, when it is the same object every call)."""
        if not tensors:
            return None
        objects: list[object] = list(tensors)
        if container is not None:
            objects.append(container)
        storages: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            st = t.untyped_storage()
            storages.setdefault(st._cdata, st)
        objects.extend(storages.values())
        watch = OutputWatch(objects, list(storages))
        for cdata, st in storages.items():
            entry = self._entries.get(cdata)
            if entry is None or entry.storage.expired():
                entry = self._entries[cdata] = _Entry(st)
            entry.watches.append(weakref.ref(watch))
        self._forget_dead()
        return watch

    def note_returned(self, tensors: Sequence[object]) -> None:
        for t in tensors:
            if isinstance(t, list | tuple):
                self.note_returned(t)
            elif isinstance(t, torch.Tensor) and (ptr := storage_ptr(t)):
                self._returned[ptr] = t

    def _knows(self, cdata: int, ptr: int) -> bool:
        entry = self._entries.get(cdata)
        if entry is not None and not entry.storage.expired():
            return True
        return bool(ptr) and ptr in self._returned

    def _watches_of(self, t: torch.Tensor) -> list[OutputWatch]:
        entry = self._entries.get(_cdata(t))
        if entry is None or entry.storage.expired():
            return []
        return [w for ref in entry.watches if (w := ref()) is not None]

    def _forget_dead(self) -> None:
        for cdata in [c for c, e in self._entries.items()
                      if e.storage.expired() or all(r() is None for r in e.watches)]:
            del self._entries[cdata]


def _cdata(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage
        return 0


# Every live ledger, to find the one that owns a tensor another callable is given (graph A's
# output fed to graph B across a graph break). Read at capture only, never on a replay.
_LEDGERS: weakref.WeakSet[OutputLedger] = weakref.WeakSet()
# A shared pool's ledger, by the pool's identity (several callables may share one pool)
_BY_POOL: weakref.WeakValueDictionary[Any, OutputLedger] = weakref.WeakValueDictionary()


def ledger_for(pool: object | None) -> OutputLedger:
    """The ledger of ``pool`` (a PoolHandle); a new one for a callable's private pools."""
    if pool is None:
        return OutputLedger()
    ledger = _BY_POOL.get(pool)
    if ledger is None:
        ledger = _BY_POOL[pool] = OutputLedger()
    return ledger


def is_result(t: torch.Tensor) -> bool:
    """``t`` shares its storage with a static output or with a result some call returned."""
    cdata, ptr = _cdata(t), storage_ptr(t)
    return any(ledger._knows(cdata, ptr) for ledger in list(_LEDGERS))


def watches_of(t: torch.Tensor) -> list[OutputWatch]:
    """The watches that count ``t``'s storage as a static output (empty for any other tensor)."""
    return [w for ledger in list(_LEDGERS) for w in ledger._watches_of(t)]


def owned_by_capture(t: torch.Tensor, counts: tuple[int, int, int],
                     watches: Sequence[OutputWatch]) -> Callable[[], None]:
    """A capture now keeps ``t`` (a static output of ``watches``' captures, or a view of one)
    and took ``counts`` references (to the tensor object, to the storage's Python object, uses of
    the storage): they count as the captures' own. Returns the undo, to be called before that
    capture lets go of them (a count below the owned one reads as held, the safe side; one above
    must never happen)."""
    storage = t.untyped_storage()
    kept = [(weakref.ref(w), w.places(t, storage)) for w in watches]
    del storage
    for (_, places), w in zip(kept, watches, strict=True):
        w.shift(places, counts)
    undone = (-counts[0], -counts[1], -counts[2])
    done = [False]

    def undo() -> None:
        if not done[0]:
            done[0] = True
            for ref, places in kept:
                if (w := ref()) is not None:
                    w.shift(places, undone)

    return undo


def references(t: torch.Tensor) -> tuple[int, int, int]:
    """The references to ``t``, to its storage's Python object and the uses of its storage,
    less the ones this call makes to read them."""
    storage = t.untyped_storage()
    return (sys.getrefcount(t) - 1, sys.getrefcount(storage) - 2,
            int(_compat.storage_use_count()(storage._cdata)))
