"""What a replay hands back: the output plan of one capture (which outputs are the caller's own
inputs, views of a user buffer rebuilt on the caller's tensor, clones, or the capture's static
tensors). Whether the caller still holds a static output is the output ledger's (ledger.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from npugraph_runtime.errors import CaptureError
from npugraph_runtime.inputs import storage_ptr
from npugraph_runtime.ledger import OutputLedger, OutputWatch

Args = tuple[object, ...]
Builder = Callable[[Args], object]


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


@dataclasses.dataclass
class OutputPlan:
    """``result`` is returned as is when ``build`` is None; else ``build(args)`` makes each
    call's result. ``watch`` is None when no static output of the capture reaches the caller."""

    result: object
    build: Builder | None
    watch: OutputWatch | None
    # the flat outputs, kept for as long as the capture: every Python reference to a static
    # output made here lives as long as the plan, so the owned counts stay exact
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
    ledger: OutputLedger,
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
    watch = ledger.watch([outs[p] for p in static],  # type: ignore[misc]
                         out if returned_as_is and type(out) is tuple else None)

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
        ledger.note_returned([res[p] for p in (*static, *clone)])
        return res

    if fixed:
        # a tensor, or a flat tuple: immutable, so the same object can be returned every call
        single = isinstance(out, torch.Tensor)

        def own_flat(args: Args) -> object:
            res = owned(args)
            return res[0] if single else tuple(res)

        if returned_as_is:
            return OutputPlan(out, None, watch, outs, own_flat)

        def build_flat(args: Args) -> object:
            res = fresh(args)
            return res[0] if single else tuple(res)

        return OutputPlan(None, build_flat, watch, outs, own_flat)

    def build(args: Args) -> object:
        # lists are rebuilt every call: a caller appending to one never changes the next result
        return unflatten(structure, iter(fresh(args)))

    def own(args: Args) -> object:
        return unflatten(structure, iter(owned(args)))

    return OutputPlan(None, build, watch, outs, own)


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
