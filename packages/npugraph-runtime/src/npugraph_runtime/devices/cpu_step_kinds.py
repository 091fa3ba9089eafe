"""The kind of each recorded op's step (what a replay issues for it): one rule per case, the
first that applies, in the order of ``KIND_RULES``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from npugraph_runtime.devices.cpu_candidates import Kind, dispatches_as
from npugraph_runtime.devices.cpu_kernels import out_candidates
from npugraph_runtime.devices.cpu_op_info import OpInfo
from npugraph_runtime.devices.cpu_record import (
    Step,
    StorageEntry,
    TensorEntry,
    TRef,
    exact_copy,
    is_plain,
)


class Recording(Protocol):
    """What the step rules ask of the recorder."""

    frozen: list[str]
    tensors: list[TensorEntry]
    storages: list[StorageEntry]

    def _ref(self, t: torch.Tensor, index: int, produced: bool = False) -> int: ...

    def _storage_of(self, t: torch.Tensor) -> int | None: ...


@dataclass(slots=True, eq=False)
class RecordedOp:
    """One op as ``Recorder._record`` saw it run: what picks the kind of its step."""

    func: Any
    info: OpInfo
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    index: int
    reason: str | None  # why it cannot be re-issued (relaxed mode freezes it), or None
    written: list[torch.Tensor]  # the inputs its schema says it writes
    leaves: list[tuple[tuple[int, ...], torch.Tensor]]  # its tensor results, by path
    outs: tuple[tuple[tuple[int, ...], TRef], ...]
    fresh: tuple[tuple[tuple[int, ...], TRef], ...]  # results in storage it allocated
    metadata_only: bool
    method: str | None  # the in-place method that may re-issue it, if any


def _frozen(rec: Recording, op: RecordedOp, step: Step) -> None:
    """Replays repeat the values it produced during capture (relaxed mode)."""
    rec.frozen.append(str(op.func))
    step.kind = Kind.FROZEN
    targets = [t for _, t in op.leaves] + op.written
    step.saved = tuple(
        (TRef(rec._ref(t, op.index)), exact_copy(t)) for t in targets if is_plain(t)
    )
    for t in targets:
        si = rec._storage_of(t)
        if si is not None and rec.storages[si].produced:
            rec.storages[si].pinned = True


def _skip(rec: Recording, op: RecordedOp, step: Step) -> None:
    """Nothing to re-issue: views (every result aliases an input), non-tensor results,
    allocations, and in-place view ops (replays see the recorded view; re-issuing would apply
    it twice)."""
    step.kind = Kind.SKIP


def _writes(rec: Recording, op: RecordedOp, step: Step) -> None:
    """An op that writes its inputs: re-issued as its in-place method where that method
    dispatches to this very op with these arguments, else as it is."""
    if op.method is not None and dispatches_as(op.method, op.func, op.args, op.kwargs):
        step.kind, step.method = Kind.INPLACE_METHOD, op.method
    else:
        step.kind = Kind.AS_IS
        step.outs = op.fresh


def _collective_wait(rec: Recording, op: RecordedOp, step: Step) -> None:
    """Returns its argument, yet must be re-issued."""
    step.kind = Kind.COLLECTIVE_WAIT


def _collective(rec: Recording, op: RecordedOp, step: Step) -> None:
    step.kind, step.outs = Kind.COLLECTIVE, op.fresh


def _as_is(rec: Recording, op: RecordedOp, step: Step) -> None:
    """Re-issued as recorded: stream markers, and custom ops with no fresh result (their schema
    may not declare what they write, so they are not trusted to be views)."""
    step.kind = Kind.AS_IS


def _computes(rec: Recording, op: RecordedOp, step: Step) -> None:
    """A computation with fresh results: computed again into them, by an out= kernel where one
    fits, else computed and copied."""
    fresh_ids = {id(r) for _, r in op.fresh}
    fresh_leaves = [
        leaf for leaf, (_, r) in zip(op.leaves, op.outs, strict=True) if id(r) in fresh_ids
    ]
    step.kind, step.outs = Kind.COPY, op.fresh
    shared = len({rec.tensors[r.i].storage for _, r in op.fresh}) != len(op.fresh)
    # results that alias inputs or each other: out= kernels would be handed overlapping
    # outputs, so only compute-and-copy fits
    step.candidates = out_candidates(
        op.func, op.args, op.kwargs, fresh_leaves,
        copy_only=len(op.fresh) != len(op.outs) or shared,
    )


# The kind of an op's step: the first rule that applies, in this order.
KIND_RULES: tuple[tuple[Callable[[RecordedOp], bool], Callable[[Recording, RecordedOp, Step], None]], ...] = (
    (lambda op: op.reason is not None, _frozen),
    (lambda op: op.metadata_only, _skip),
    (lambda op: bool(op.written), _writes),
    (lambda op: op.info.wait, _collective_wait),
    (lambda op: op.info.functional_collective and bool(op.fresh), _collective),
    (lambda op: op.info.event_marker, _skip),  # ordered by program order at replay
    (lambda op: op.info.marker, _as_is),
    (lambda op: not op.fresh and not op.info.trusted_schema, _as_is),
    (lambda op: not op.fresh or op.info.allocation, _skip),
    (lambda op: True, _computes),
)
