"""What a replay hands back: the output plan of one capture (which outputs are the caller's own
inputs, views of a user buffer rebuilt on the caller's tensor, clones, or the capture's static
tensors), and the cheap test of whether the static outputs of the previous replay are still held.

A static output is held when a Python reference to the tensor object we returned exists outside
the capture (its refcount is above the one counted when nothing was handed out yet) or when any
tensor still uses its storage (a view, an ``untyped_storage()``: the storage's use count is above
the settled one). Both are C-level counters read in one call each, so the test costs a few
hundred nanoseconds and never scans Python objects."""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from npugraph_runtime import _compat
from npugraph_runtime.errors import CaptureError
from npugraph_runtime.inputs import storage_ptr

Args = tuple[object, ...]
Builder = Callable[[Args], object]


# Storage address -> a tensor some capture handed (or will hand) to its caller: a static output, or
# a first call's own result. Under clone_input=False such a tensor (one graph's result fed to the
# next graph across a graph break) must not become a capture's buffer, since refilling that buffer
# would overwrite a result the caller may hold. Written at capture only, never on a replay.
_RESULTS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def _note_results(tensors: Sequence[object]) -> None:
    for t in tensors:
        if isinstance(t, list | tuple):
            _note_results(t)
        elif isinstance(t, torch.Tensor) and (ptr := storage_ptr(t)):
            _RESULTS[ptr] = t


def note_result(out: object) -> None:
    """Note the tensors of a call's result that did not come from a replay (a warmup's)."""
    _note_results(out if isinstance(out, list | tuple) else [out])


def is_result(t: torch.Tensor) -> bool:
    """``t`` shares its storage with a tensor a capture returned to its caller."""
    ptr = storage_ptr(t)
    return bool(ptr) and ptr in _RESULTS


@dataclasses.dataclass(frozen=True)
class _BufferView:
    """An output that views a user input's capture buffer, rebuilt on the caller's tensor."""

    pos: int  # position among the flattened outputs
    slot: int  # the user input
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements from the buffer's own storage offset
    dtype: torch.dtype
    buffer_stride: tuple[int, ...]


class Holds:
    """The objects and storages of a capture's static outputs that a caller may keep, and their
    reference counts when nothing outside the capture holds them (``settle`` before the first
    hand-out). The replay closure compares ``counts()``, inlined, with ``base``."""

    __slots__ = ("__weakref__", "base", "cdatas", "objects", "storages", "use_count")

    def __init__(self, objects: list[object], storages: list[torch.UntypedStorage]) -> None:
        self.objects = objects
        self.storages = storages  # kept alive here: their use count includes this reference
        self.cdatas: list[int] = [s._cdata for s in storages]
        self.use_count = _compat.storage_use_count()
        self.base: tuple[list[int], list[int]] = ([], [])
        for cdata in self.cdatas:
            _LENDERS[cdata] = self

    def counts(self) -> tuple[list[int], list[int]]:
        return list(map(sys.getrefcount, self.objects)), list(map(self.use_count, self.cdatas))

    def settle(self) -> None:
        self.base = self.counts()

    def lend(self, t: torch.Tensor, refs: int, uses: int) -> Callable[[], None]:
        """Another capture keeps ``t`` (one of these outputs, or a view of one) as its own input
        and holds ``refs`` references to it and ``uses`` uses of its storage: count them as
        not the caller's. Graph B that updates graph A's result in place across a graph break
        (``res.add_(...)`` in a layer's second half) keeps it: without this A would see its
        output held on every call and make a capture each call, and B, seeing a new address,
        one more. Returns the undo, to be called before B lets go of them (a count below the
        settled one reads as held, the safe side; one above must never happen)."""
        at_object = next((k for k, o in enumerate(self.objects) if o is t), None)
        at_storage = self.cdatas.index(t.untyped_storage()._cdata)
        _shift(self, at_object, refs, at_storage, uses)
        lender = weakref.ref(self)
        done = [False]

        def undo() -> None:
            holds = lender()
            if holds is not None and not done[0]:
                done[0] = True
                _shift(holds, at_object, -refs, at_storage, -uses)

        return undo


def _shift(holds: Holds, at_object: int | None, refs: int, at_storage: int, uses: int) -> None:
    objects, storages = holds.base
    if at_object is not None and at_object < len(objects):
        objects[at_object] += refs
    if at_storage < len(storages):
        storages[at_storage] += uses


# A static output's storage (its C++ address) -> the Holds of the capture that hands it out,
# for a later capture that keeps such a tensor as its input (Holds.lend)
_LENDERS: weakref.WeakValueDictionary[int, Holds] = weakref.WeakValueDictionary()


def lender(t: torch.Tensor) -> Holds | None:
    """The Holds of the capture whose static output ``t`` is, or views; None for any other."""
    try:
        cdata = t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage
        return None
    return _LENDERS.get(cdata)


@dataclasses.dataclass
class OutputPlan:
    """``result`` is returned as is when ``build`` is None; else ``build(args)`` makes each
    call's result. ``holds`` is None when no static output of the capture reaches the caller."""

    result: object
    build: Builder | None
    holds: Holds | None
    # the flat outputs, kept for as long as the capture: every Python reference to a static
    # output made here lives as long as the plan, so the settled counts stay exact
    outs: list[object]
    # the result with every static output cloned too (nothing a replay overwrites): the call's
    # result when it is the capture's own run
    own: Builder


def output_plan(
    out: object,
    name: str,
    cap_args: Sequence[object],
    user: Sequence[int],
    buffers: Sequence[torch.Tensor],
    in_place: set[int],
    declared: Sequence[int | None],
    clone_output: bool,
) -> OutputPlan:
    """What a replay returns: a fixed object, or a builder when outputs alias inputs or are
    cloned. An output that is exactly an input (per ``declared``, or found at capture) is
    returned as the caller's input; a view of an input the graph uses in place (``in_place``) is
    never cloned; every other tensor is cloned when ``clone_output``."""
    if not isinstance(out, torch.Tensor) and type(out) not in (tuple, list):
        raise CaptureError(
            f"{name}: fn returned a {type(out).__name__}; a GraphedCallable needs fn to "
            "return a tensor, or a tuple or list of tensors"
        )
    outs, structure = flatten(out, name)
    user_buffers = {storage_ptr(b): (i, b) for i, b in zip(user, buffers, strict=True)}
    user_buffers.pop(0, None)
    alias: list[tuple[int, int]] = []
    clone: list[int] = []
    views: list[_BufferView] = []
    static: list[int] = []  # static outputs handed to the caller as they are
    for pos, o in enumerate(outs):
        if not isinstance(o, torch.Tensor):
            continue
        j = declared[pos] if pos < len(declared) else None
        if j is None:
            j = next((i for i, a in enumerate(cap_args) if same_view(o, a)), None)
        if j is None:
            # a view of an input used in place (cache[0], weight.t()): eager returns that view
            # of the caller's tensor, so clone_output must not clone it
            j = next((i for i in sorted(in_place)
                      if same_storage(o, cap_args[i])), None)  # type: ignore[arg-type]
        hit = user_buffers.get(storage_ptr(o))
        if j is not None and same_view(o, cap_args[j]):
            alias.append((pos, j))
        elif hit is not None:
            # a view of a user input's buffer: eager returns that view of the caller's
            # tensor, and a buffer view must never reach the caller (fed back as an input,
            # it would change while the buffers are refilled)
            i, b = hit
            views.append(_BufferView(pos, i, tuple(o.shape), o.stride(),
                                     int(o.storage_offset() - b.storage_offset()), o.dtype,
                                     b.stride()))
        elif j is not None and j in in_place and same_storage(o, cap_args[j]):  # type: ignore[arg-type]
            continue  # a view of the caller's own tensor, as in eager
        elif clone_output:
            clone.append(pos)
        else:
            static.append(pos)
    singles, groups = _clone_groups(outs, clone)
    static_singles, static_groups = _clone_groups(outs, static)
    fixed = isinstance(out, torch.Tensor) or structure is None
    returned_as_is = fixed and not alias and not clone and not views
    holds = _holds(outs, static, out if returned_as_is and type(out) is tuple else None)
    _note_results([outs[p] for p in static])

    def place(res: list[object], args: Args) -> None:
        for p, j in alias:
            res[p] = args[j]
        for v in views:
            a: torch.Tensor = args[v.slot]  # type: ignore[assignment]
            if a.dtype == v.dtype and a.stride() == v.buffer_stride:
                res[v.pos] = a.as_strided(v.size, v.stride, a.storage_offset() + v.offset)
            else:  # the caller's layout differs from the buffer's: a copy of the values
                res[v.pos] = res[v.pos].clone()  # type: ignore[attr-defined]

    def fresh(args: Args) -> list[object]:
        """This call's flat outputs: clones where asked, the caller's inputs where aliased."""
        res: list[object] = list(outs)
        for p in singles:
            res[p] = res[p].clone()  # type: ignore[attr-defined]
        for group in groups:
            for p, t in zip(group, clone_together([res[p] for p in group]), strict=True):  # type: ignore[misc]
                res[p] = t
        place(res, args)
        return res

    def owned(args: Args) -> list[object]:
        res = fresh(args)
        for p in static_singles:
            res[p] = res[p].clone()  # type: ignore[attr-defined]
        for group in static_groups:
            for p, t in zip(group, clone_together([res[p] for p in group]), strict=True):  # type: ignore[misc]
                res[p] = t
        _note_results([res[p] for p in (*static, *clone)])
        return res

    if fixed:
        # a tensor, or a flat tuple: immutable, so the same object can be returned every call
        single = isinstance(out, torch.Tensor)

        def own_flat(args: Args) -> object:
            res = owned(args)
            return res[0] if single else tuple(res)

        if returned_as_is:
            return OutputPlan(out, None, holds, outs, own_flat)

        def build_flat(args: Args) -> object:
            res = fresh(args)
            return res[0] if single else tuple(res)

        return OutputPlan(None, build_flat, holds, outs, own_flat)

    def build(args: Args) -> object:
        # lists are rebuilt every call: a caller appending to one never changes the next result
        return unflatten(structure, iter(fresh(args)))

    def own(args: Args) -> object:
        return unflatten(structure, iter(owned(args)))

    return OutputPlan(None, build, holds, outs, own)


def _holds(outs: Sequence[object], static: Sequence[int], container: object | None) -> Holds | None:
    if not static:
        return None
    objects: list[object] = [outs[p] for p in static]
    if container is not None:
        objects.append(container)
    storages: dict[int, torch.UntypedStorage] = {}
    for p in static:
        st = outs[p].untyped_storage()  # type: ignore[attr-defined]
        storages.setdefault(int(st.data_ptr()) or -1 - p, st)
    return Holds(objects, list(storages.values()))


# The nesting of fn's result: None for a leaf, else (is_list, children). A flat tuple's
# structure is None too (see flatten).
Structure = tuple[bool, list[Any]] | None


def flatten(out: object, name: str) -> tuple[list[object], Structure]:
    """The leaves of ``out`` (nested tuples and lists of tensors and constants) in order, and its
    structure; (leaves, None) when ``out`` is a tensor or a tuple with no tuple or list inside."""
    if isinstance(out, torch.Tensor):
        return [out], None
    leaves: list[object] = []

    def walk(value: object) -> Any:
        if type(value) in (tuple, list):
            return (type(value) is list, [walk(v) for v in value])  # type: ignore[attr-defined]
        if isinstance(value, dict) or (
            isinstance(value, tuple | list) and any(isinstance(v, torch.Tensor) for v in value)
        ):
            raise CaptureError(
                f"{name}: fn returned a {type(value).__name__} inside its result; a "
                "GraphedCallable returns tensors nested in tuples and lists only"
            )
        leaves.append(value)
        return None

    structure = walk(out)
    if not structure[0] and all(child is None for child in structure[1]):
        return leaves, None
    return leaves, structure


def unflatten(structure: Structure, leaves: Iterator[object]) -> object:
    if structure is None:
        return next(leaves)
    is_list, children = structure
    items = [unflatten(child, leaves) for child in children]
    return items if is_list else tuple(items)


def _clone_groups(outs: Sequence[object], clone: Sequence[int]) -> tuple[list[int], list[list[int]]]:
    """The outputs to clone alone, and the groups that share a storage and are cloned together
    (so a caller's write through one shows through the others, as in eager)."""
    by_storage: dict[int, list[int]] = {}
    for p in clone:
        by_storage.setdefault(storage_ptr(outs[p]) or -1 - p, []).append(p)  # type: ignore[arg-type]
    singles = [ps[0] for ps in by_storage.values() if len(ps) == 1]
    return singles, [ps for ps in by_storage.values() if len(ps) > 1]


def clone_together(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Clones of views of one storage that share one new storage, laid out as the originals."""
    align = max(t.element_size() for t in tensors)
    spans = [
        (t.storage_offset() * t.element_size(),
         (t.storage_offset() + sum((n - 1) * d for n, d in zip(t.shape, t.stride(), strict=True)) + 1)
         * t.element_size())
        for t in tensors
        if t.numel()
    ]
    if not spans:
        return [t.clone() for t in tensors]
    lo = min(a for a, _ in spans)
    lo -= lo % align
    hi = max(b for _, b in spans)
    raw = torch.empty(0, dtype=torch.uint8, device=tensors[0].device)
    source = raw.set_(tensors[0].untyped_storage(), lo, (hi - lo,), (1,))
    storage = source.clone().untyped_storage()
    return [
        torch.empty(0, dtype=t.dtype, device=t.device).set_(
            storage, max(t.storage_offset() * t.element_size() - lo, 0) // t.element_size(),
            t.shape, t.stride(),
        )
        for t in tensors
    ]


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def same_view(a: torch.Tensor, b: object) -> bool:
    if a is b:
        return True
    return (
        isinstance(b, torch.Tensor)
        and same_storage(a, b)
        and a.storage_offset() == b.storage_offset()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )
