"""How each input slot reaches a capture (its binding), and the replay closure generated from a
capture's bindings.

The bindings are a closed set:

* ``PINNED``: the capture reads the caller's tensor where it is (static and mutated inputs); the
  replay checks its address, and another address is another capture (selection.py);
* ``COPY_IN``: the caller's tensor is copied into the capture's buffer before the replay (user
  inputs; only when its address changed, unless ``clone_input``);
* ``COPY_IN_OUT``: copied into a buffer of the key's own before the replay and back after it (a
  mutated or static input new on every call; the buffers and their history: copied_inputs.py):
  the slots of a capture made over those buffers, while the key copies;
* ``MIRROR``: the caller's whole storage is mirrored into the buffer (an input the graph reads
  through ``as_strided``).

A slot's history moves it between bindings (a tensor new on every call to COPY_IN_OUT, one that
comes back to PINNED); the closure of a capture is generated from the bindings it has."""

from __future__ import annotations

import enum
import functools
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from npugraph_runtime import _compat
from npugraph_runtime.copied_inputs import CopiedInputs
from npugraph_runtime.core_limit import capture_core_limit
from npugraph_runtime.inputs import mirror_filler, refiller
from npugraph_runtime.keys import Args, picker

if TYPE_CHECKING:
    from npugraph_runtime.capture import Capture, Slots
    from npugraph_runtime.outputs import OutputPlan

__all__ = ["MISS", "REPLAY_RANGE", "Binding", "replay_closure", "slot_bindings"]

# what a replay closure returns when its capture cannot serve the call (other addresses,
# another core limit, outputs still held): the caller then looks for another capture
MISS: Any = object()
REPLAY_RANGE = "npugraph_ex::replay"

_data_ptr = torch.Tensor.data_ptr


class Binding(enum.Enum):
    PINNED = "pinned"
    COPY_IN = "copy_in"
    COPY_IN_OUT = "copy_in_out"
    MIRROR = "mirror"


def slot_bindings(slots: Slots, cap: Capture, copied: CopiedInputs | None) -> dict[int, Binding]:
    """The binding of each tensor slot of ``cap``. The slots a key copies (``copied``) are
    COPY_IN_OUT in a capture made over all of their buffers; a capture made before (over the
    caller's tensors, or over fewer buffers) keeps them PINNED, and misses on the caller's new
    tensors."""
    bindings = {i: Binding.PINNED for i in (*slots.static, *slots.mutated)}
    bindings.update({i: Binding.MIRROR if i in cap.mirrored else Binding.COPY_IN for i in slots.user})
    if copied is not None and all(cap.addresses.get(i) == _data_ptr(b)
                                  for i, b in zip(copied.slots, copied.buffers, strict=True)):
        bindings.update(dict.fromkeys(copied.slots, Binding.COPY_IN_OUT))
    return bindings


def replay_closure(
    name: str, cap: Capture, bindings: dict[int, Binding], slots: Slots, n_inputs: int,
    held: tuple[object, ...] | None,
    copy: Callable[[list[torch.Tensor], Sequence[torch.Tensor]], object],
    ptrs_equal: Callable[[list[object], list[int | None], list[int]], bool] | None,
    clone_input: bool,
    changed_constant: Callable[[Args, tuple[object, ...]], None],
    copied: CopiedInputs | None = None,
) -> Callable[[Args], object]:
    """The replay closure of ``cap`` (whose output plan is made): check the PINNED addresses,
    fill the COPY_IN buffers and MIRRORs, copy the COPY_IN_OUT slots into ``copied``'s buffers,
    replay, copy them back, return the plan's result over the caller's tensors. With ``held``
    (bind), one that takes only the inputs before them (never one that copies)."""
    replay = cap.graph.replay
    if cap.new_tensor:
        replay = _noting_replays(cap.replayed, replay)
    core_limit, captured_limit = capture_core_limit, cap.core_limit
    # the PINNED inputs whose addresses are checked (slots.watched: every mutated input, the
    # static ones check_static_addresses asks for): in one C++ call where torch has one, else in
    # one pass of data_ptr (~55 ns a tensor)
    watched = [i for i in slots.watched if bindings[i] is Binding.PINNED]
    n = n_inputs if held is None else n_inputs - len(held)
    bound_objects: list[Any] | None = None  # tensors: held inputs are static
    bound_ptrs: list[int | None] = []
    bound_at: list[int] = []
    if held is not None:  # held inputs: checked over the objects, no picking
        bound_objects = [held[i - n] for i in watched if i >= n]
        bound_ptrs = [cap.addresses[i] for i in watched if i >= n]
        bound_at = list(range(len(bound_objects)))
        watched = [i for i in watched if i < n]
    watched_ptrs = [cap.addresses[i] for i in watched]
    pick_watched = _tensor_picker(watched)
    all_equal = ptrs_equal if watched else None
    by_slot: list[int | None] = [cap.addresses.get(i) if i in watched else None for i in range(n)]
    plain_slots = [i for i in slots.user if bindings[i] is Binding.COPY_IN]
    pick_user = _tensor_picker(plain_slots)
    buffers = [b for i, b in zip(slots.user, cap.buffers, strict=True)
               if bindings[i] is Binding.COPY_IN]
    always_copy = clone_input  # owned buffers never equal a caller's tensor
    unchanged, refill = refiller(buffers, copy, plain_slots)
    mirrored = sorted(i for i in slots.user if bindings[i] is Binding.MIRROR)
    pick_mirrored = _tensor_picker(mirrored)
    fill_mirrors = mirror_filler(
        [cap.buffers[slots.user.index(i)] for i in mirrored], mirrored, name)
    plan = cap.plan
    assert plan is not None
    # the result is read from the plan: a closure made after the capture's counts settled
    # (bind) must not add a reference to an output it hands out
    build, watch = plan.build, plan.watch
    # What tells whether the caller still holds the previous replay's outputs (ledger.py)
    held_objects = watch.objects if watch is not None else []
    held_storages = watch.cdatas if watch is not None else []
    refcount, use_count = sys.getrefcount, _compat.storage_use_count()
    data_ptr = _data_ptr
    pick_constants = picker(slots.constant)
    constants = pick_constants(tuple(cap.args)) if pick_constants is not None else ()

    profiling = _compat.profiler_enabled
    copying = None
    if Binding.COPY_IN_OUT in bindings.values():
        assert copied is not None and held is None
        copying = _copying(copied, replay, build, plan)

    # one frame a call: the profiler range re-enters it once with ``ranged``
    def run(args: Args, ranged: bool = False) -> object:
        if not ranged and profiling():
            with torch.profiler.record_function(REPLAY_RANGE):
                return run(args, True)
        if pick_constants is not None and not equal(pick_constants(args), constants):
            changed_constant(args, constants)
        if core_limit() != captured_limit:
            return MISS
        # the caller still holds the previous replay's outputs: checked first, it is the
        # cheap test that makes a decode loop move to the other capture of the key
        if watch is not None and (
            list(map(refcount, held_objects)), list(map(use_count, held_storages))
        ) != watch.base:
            return MISS
        if bound_objects is not None and (
                list(map(data_ptr, bound_objects)) != bound_ptrs if ptrs_equal is None
                else not ptrs_equal(bound_objects, bound_ptrs, bound_at)):
            return MISS
        if all_equal is not None:
            if not all_equal(list(args), by_slot, watched):
                return MISS
        elif pick_watched is not None and list(map(data_ptr, pick_watched(args))) != watched_ptrs:
            return MISS
        if pick_user is not None:
            sources = pick_user(args)
            if always_copy:
                copy(buffers, sources)
            elif not unchanged(sources):
                refill(sources)
        if pick_mirrored is not None:
            fill_mirrors(pick_mirrored(args))
        if copying is not None:
            return copying(args)
        replay()
        if build is None:
            return plan.result
        return build(args if held is None else (*args, *held))

    return run


def _copying(copied: CopiedInputs, replay: Callable[[], None],
             build: Callable[[Args], object] | None, plan: OutputPlan) -> Callable[[Args], object]:
    """The COPY_IN_OUT stages of a replay: copy in, replay, copy back, the result remapped onto
    the caller's tensors; MISS where the key leaves copying (``copied.leaving``)."""
    enter, leave = copied.enter, copied.leave

    def run(args: Args) -> object:
        sub = enter(args)
        if sub is None:
            return MISS
        replay()
        out = plan.result if build is None else build(sub)
        return leave(out, args)

    return run


def _noting_replays(replayed: list[bool], replay: Callable[[], None]) -> Callable[[], None]:
    def noted() -> None:
        replayed[0] = True
        replay()

    return noted


def _tensor_picker(indices: Sequence[int]) -> Callable[[Args], tuple[torch.Tensor, ...]] | None:
    """``picker`` for inputs the InputSpec makes tensors (checked before any capture)."""
    return cast("Callable[[Args], tuple[torch.Tensor, ...]] | None", picker(indices))


def equal(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Constant inputs equal (identical, or ``==`` where that answers a plain bool)."""
    try:
        return bool(a == b)
    except Exception:  # an object whose == is elementwise or refuses (numpy arrays)
        return all(x is y for x, y in zip(a, b, strict=True))


@functools.cache
def checked_ptrs_equal() -> Callable[[list[object], list[int | None], list[int]], bool] | None:
    """torch's C++ address check where it exists and answers as we read it; None otherwise."""
    found = _compat.data_ptrs_at_indices_equal()
    if found is None:
        return None
    a, b = torch.zeros(1), torch.zeros(1)
    try:
        right = found([a, 0, b], [a.data_ptr(), None, b.data_ptr()], [0, 2]) and not found(
            [a, 0, a], [a.data_ptr(), None, b.data_ptr()], [0, 2]
        )
    except (TypeError, RuntimeError):
        return None
    return found if right else None
