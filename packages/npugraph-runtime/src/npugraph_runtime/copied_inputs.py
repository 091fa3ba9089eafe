"""Inputs that come at a new address on every call, served through buffers of a graph key's
own.

A key's mutated inputs select its capture by address: a request's KV cache keeps its capture
for as long as the request runs. A tensor that is new on every call would make every call a
capture instead (a forward updating the caller's fresh input in place, ``x.mul_(2)``; a state
fed back, ``h = f(h, x)`` with ``h.add_`` inside; another graph's cloned result updated across
a graph break). When a key replaces a capture that was made for a new tensor, whose tensor the
caller dropped before any later call replayed it, it switches to this: before each replay the
caller's tensors are copied into the key's buffers, the graph runs on the buffers (one address:
it replays), and after it the buffers are copied back into the caller's tensors, which the call
hands out wherever the graph returns a buffer or a view of one, as eager returns the caller's
tensor. A request's cache that lives for several calls is replayed before it is dropped, so it
is never copied (the copies would cost two passes over it a call); one that comes once the key
copies (after requests of one call each) is seen on its ``LIVES``-th call, and the key leaves
this mode for it (``lives``): its own capture replays the rest of the request. A static input that is new on
every call (a buffer the forward re-binds, ``self.steps = self.steps + 1``: its old tensor is
dropped, and the capture for it released unreplayed) is copied in the same way, but not back.

Only tensors that are the whole of their storage (offset 0, dense) are copied, and a call must
pass such tensors with the captured strides: a graph reading its input through ``as_strided``
reads absolute storage positions, which are the same in the buffer only then. Any other call
leaves this mode for the key (the capture manager's address rules again)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import cast

import torch

from npugraph_runtime.inputs import storage_ptr
from npugraph_runtime.keys import Args
from npugraph_runtime.ledger import is_result
from npugraph_runtime.spans import non_overlapping

__all__ = ["LIVES", "CopiedInputs"]


def _no_copy(dst: list[torch.Tensor], src: Sequence[torch.Tensor]) -> object:
    raise AssertionError("CopiedInputs used before its key served it (misses._start_copying)")


def _no_room(live: int) -> bool:
    return False

# Calls with the same mutated tensors after which they are a request's (lives), not new on each
# call: a tensor passed two or three times is still cheaper to copy than to capture for
LIVES = 3


def _whole(t: object) -> bool:
    """``t`` is all of its storage: offset 0, no gaps, no two elements in one place."""
    return (
        type(t) is torch.Tensor
        and t.numel() > 0
        and t.storage_offset() == 0
        and non_overlapping(t)
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


class CopiedInputs:
    """The buffers of one graph key's copied inputs (the COPY_IN_OUT binding of its captures
    made over them: bindings.py) and the history that tells when the key leaves this mode.
    ``written``: the positions among them of the mutated inputs, copied back after each replay
    (a static input is only read). ``leaving``: a call found that the key should leave."""

    __slots__ = ("buffers", "by_storage", "copy", "layouts", "leaving", "room", "seen", "slots",
                 "written", "written_buffers")

    def __init__(self, slots: Sequence[int], args: Args, mutated: Sequence[int] = ()) -> None:
        self.slots: list[int] = []
        self.buffers: list[torch.Tensor] = []
        self.layouts: list[tuple[tuple[int, ...], torch.dtype, int]] = []
        self.by_storage: dict[int, int] = {}
        self.written: list[int] = []
        self.written_buffers: list[torch.Tensor] = []
        self.add(slots, args)
        for k, i in enumerate(self.slots):
            if i in mutated:
                self.written.append(k)
                self.written_buffers.append(self.buffers[k])
        self.leaving = False
        self.copy: Callable[[list[torch.Tensor], Sequence[torch.Tensor]], object] = _no_copy
        # whether the key may capture for this many live sets of tensors (capture_limit)
        self.room: Callable[[int], bool] = _no_room
        # ids of the mutated tensors of recent calls -> (weak references to them, calls seen)
        self.seen: dict[tuple[int, ...], tuple[list[weakref.ref[torch.Tensor]], int]] = {}

    def enter(self, args: Args) -> Args | None:
        """The call's arguments with the buffers in place of the copied inputs, filled from
        them; None (``leaving`` set) where the key leaves this mode: another layout or a view
        (the address rules again), or a request's cache that lives (its own capture, no
        copies; not where the tensors the caller keeps in turn are more captures than
        capture_limit allows). Arguments that hold the buffers already are returned as they
        are (a fresh capture's own replay)."""
        if not self.fits(args):
            self.leaving = True
            return None
        sources = self.sources(args)
        if sources[0] is self.buffers[0]:
            return args
        if self.lives(sources) and self.room(self.live()):
            self.leaving = True
            return None
        self.copy(self.buffers, sources)
        return self.substitute(args)

    def leave(self, out: object, args: Args) -> object:
        """After a run over the buffers: the mutated inputs copied back into the caller's
        tensors, and ``out`` returned over them (remap)."""
        sources = self.sources(args)  # with any input copied from this call on
        if sources[0] is self.buffers[0]:
            return out
        if self.written:
            self.copy([sources[k] for k in self.written], self.written_buffers)
        return self.remap(out, sources)

    def lives(self, sources: Sequence[torch.Tensor]) -> bool:
        """The mutated tensors of this call came on ``LIVES`` calls (a request's cache, alone or
        in turn with others'): the address rules serve them with no copies. Not a state fed
        back (``h = f(h, x)``), which is the static output of one capture or another in turn."""
        tensors = [sources[k] for k in self.written]
        if not tensors or any(map(is_result, tensors)):
            return False  # a state fed back: a capture's outputs, passed in turn
        ids = tuple(map(id, tensors))
        was = self.seen.get(ids)
        calls = 1
        if was is not None and all(r() is t for r, t in zip(was[0], tensors, strict=True)):
            calls = was[1] + 1
        elif len(self.seen) >= 4 * LIVES:  # new tensors on every call: forget the dead ones
            self.seen = {k: v for k, v in self.seen.items() if all(r() is not None for r in v[0])}
            if len(self.seen) >= 4 * LIVES:  # many live ones in turn: copied, as they come
                self.seen.clear()
        self.seen[ids] = ([weakref.ref(t) for t in tensors], calls)
        return calls >= LIVES

    def live(self) -> int:
        """The sets of mutated tensors seen lately that the caller still holds: each would get a
        capture of its own once the key leaves this mode."""
        return sum(all(r() is not None for r in refs) for refs, _ in self.seen.values())

    def add(self, slots: Sequence[int], args: Args, written: bool = False) -> None:
        """Buffers for ``slots`` too (``written``: mutated inputs, copied back after a replay)."""
        for i in slots:
            t: torch.Tensor = args[i]  # type: ignore[assignment]
            b = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
            if written:
                self.written.append(len(self.buffers))
                self.written_buffers.append(b)
            self.by_storage[storage_ptr(b)] = len(self.buffers)
            self.slots.append(i)
            self.buffers.append(b)
            self.layouts.append((b.stride(), b.dtype, b.untyped_storage().nbytes()))

    @staticmethod
    def eligible(slots: Sequence[int], args: Args) -> bool:
        """Every tensor of ``slots`` is the whole of its storage and shares it with no other
        input (a copy would part them: eager sees a write through every alias)."""
        if not slots or not all(_whole(args[i]) for i in slots):
            return False
        ours = {storage_ptr(args[i]) for i in slots}  # type: ignore[arg-type]
        if len(ours) != len(slots):
            return False
        others = [a for j, a in enumerate(args) if j not in slots and isinstance(a, torch.Tensor)]
        return not any(storage_ptr(a) in ours for a in others)

    def fits(self, args: Args) -> bool:
        """This call's tensors can be copied into the buffers and stand for them."""
        for i, (stride, dtype, nbytes) in zip(self.slots, self.layouts, strict=True):
            t = args[i]
            if not (type(t) is torch.Tensor and t.storage_offset() == 0 and t.dtype is dtype
                    and t.stride() == stride and t.untyped_storage().nbytes() == nbytes):
                return False
        return True

    def sources(self, args: Args) -> list[torch.Tensor]:
        return [args[i] for i in self.slots]  # type: ignore[misc]

    def substitute(self, args: Args) -> Args:
        sub = list(args)
        for i, b in zip(self.slots, self.buffers, strict=True):
            sub[i] = b
        return tuple(sub)

    def remap(self, out: object, sources: Sequence[torch.Tensor]) -> object:
        """``out`` with every buffer replaced by the caller's tensor and every view of one by
        the same view of the caller's tensor (same offsets: both are whole storages)."""
        if isinstance(out, torch.Tensor):
            k = self.by_storage.get(storage_ptr(out)) if out.untyped_storage().nbytes() else None
            if k is None:
                return out
            if out is self.buffers[k]:
                return sources[k]
            return sources[k].as_strided(out.size(), out.stride(), out.storage_offset())
        if type(out) is tuple:
            return tuple(self.remap(o, sources) for o in cast(tuple[object, ...], out))
        if type(out) is list:
            return [self.remap(o, sources) for o in cast(list[object], out)]
        return out
