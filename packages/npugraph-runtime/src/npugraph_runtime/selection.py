"""Which capture serves a call that the key's last capture could not replay.

A key keeps several captures beside each other: one per set of static addresses, one per set of
mutated tensors the caller still holds (requests with their own KV caches), one more where the
caller held outputs. When no capture of the key replays a call, ``choose`` says why a new one is
needed and which one, if any, it replaces."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from npugraph_runtime.capture import Capture, Slots, tensor
from npugraph_runtime.counters import (
    CORE_LIMIT_CHANGE,
    HELD_OUTPUTS,
    MUTATED_INPUT_CHANGE,
    STATIC_INPUT_CHANGE,
)
from npugraph_runtime.errors import PolicyError
from npugraph_runtime.keys import Args

__all__ = ["Choice", "choose", "same_layouts"]

_data_ptr = torch.Tensor.data_ptr


class Choice(NamedTuple):
    """Capture again for ``reason``: in place of ``replacing``, or (None) beside the others
    within capture_limit."""

    reason: str
    replacing: Capture | None = None


def choose(
    name: str, slots: Slots, caps: Sequence[Capture], args: Args, limit: tuple[str, int, int] | None,
    room: bool,
) -> Choice:
    """The capture to make for ``args``, none of ``caps`` replaying it; ``limit`` is the core
    limit now, ``room`` whether capture_limit allows one more capture."""
    watched = slots.watched
    if any(c.core_limit == limit and c.fits(args, watched) for c in caps):
        return Choice(HELD_OUTPUTS)
    same_layouts(name, slots, args, caps[0])
    statics = [i for i in watched if i not in slots.mutated]
    same_statics = [c for c in caps if all(
        _data_ptr(tensor(args, i)) == c.addresses[i] for i in statics)]
    old = next((c for c in same_statics if c.core_limit == limit), None)
    if old is not None:
        # other mutated tensors (another request's KV cache): a capture beside the others,
        # so requests served in turn replay their own; one whose tensors the caller dropped
        # is replaced, and so is the first at capture_limit
        gone = next((c for c in same_statics if c.core_limit == limit and c.dropped()), None)
        if gone is None and room:
            return Choice(MUTATED_INPUT_CHANGE)
        return Choice(MUTATED_INPUT_CHANGE, gone or old)
    old = next((c for c in same_statics if c.fits(args, watched)), None)
    if old is not None:
        return Choice(CORE_LIMIT_CHANGE, old)
    return Choice(STATIC_INPUT_CHANGE)


def same_layouts(name: str, slots: Slots, args: Args, first: Capture) -> None:
    """A static or mutated input at a new address must have the layout the graph was made
    for: a graph traced for one shape replayed (or captured) on another gives wrong numbers
    or crashes, and under cache_compile's serving path no guard of torch's checks a
    parameter's shape on every call."""
    for i in (*slots.static, *slots.mutated):
        new, was = args[i], first.args[i]
        if not isinstance(new, torch.Tensor) or not isinstance(was, torch.Tensor):
            continue
        got = (tuple(new.shape), new.stride(), new.dtype, new.device)
        want = (tuple(was.shape), was.stride(), was.dtype, was.device)
        if got != want:
            kind = "mutated" if i in slots.mutated else "static"
            raise PolicyError(
                f"{name}: {kind} input {i} (a parameter, buffer or cache) was re-bound to "
                f"a tensor of shape {got[0]}, stride {got[1]}, {got[2]} on {got[3]}, but the "
                f"graph was made for shape {want[0]}, stride {want[1]}, {want[2]} on "
                f"{want[3]}. Re-bind it to a tensor of the same layout (copy_ into it), or "
                "compile again for the new layout"
            )
