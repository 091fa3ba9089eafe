"""The captures a GraphedCallable holds, by graph key: making one (warmup, recording, the output
plan its replay closure returns through), one more beside the others within capture_limit,
releasing those of a dropped model (orphans), and falling back to eager. manager.py holds the
call path over them, misses.py what a call its key's closure cannot serve does."""

from __future__ import annotations

import gc
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from npugraph_runtime import _compat
from npugraph_runtime.bindings import (
    MISS,
    Binding,
    checked_ptrs_equal,
    equal,
    replay_closure,
    slot_bindings,
)
from npugraph_runtime.callsite import warn_at_caller
from npugraph_runtime.capture import (
    Capture,
    Slots,
    capture_runs_fn,
    orphaned_captures,
    record,
    storage_uses,
    undone_runs,
    warm_up,
)
from npugraph_runtime.collector import collector_paused
from npugraph_runtime.copied_inputs import CopiedInputs
from npugraph_runtime.counters import (
    CAPTURE_LIMIT,
    FORCE_RECAPTURE,
    HELD_OUTPUTS,
    NEW_KEY,
    CaptureEvent,
    CounterNames,
    default_name,
    logger,
)
from npugraph_runtime.devices.base import PoolHandle
from npugraph_runtime.errors import CaptureError, PolicyError
from npugraph_runtime.graphs import as_pool_handle, graph_pool_handle
from npugraph_runtime.inputs import storage_ptr
from npugraph_runtime.keys import NEEDS_GRAD, Args, Key, key_function
from npugraph_runtime.ledger import (
    OutputLedger,
    ledger_for,
    owned_by_capture,
    references,
    watches_of,
)
from npugraph_runtime.outputs import OutputPlan, output_plan
from npugraph_runtime.spec import CapturePolicy, InputSpec, OutputSpec, SlotKind

__all__ = ["CaptureSet"]

_NO_RESULT: Any = object()
_TENSOR_KINDS = (SlotKind.STATIC, SlotKind.MUTATED, SlotKind.USER)



class CaptureSet:
    """The state of a GraphedCallable and what makes, replaces and releases its captures (see
    GraphedCallable for the contract)."""

    def __init__(
        self,
        fn: Callable[..., object],
        spec: InputSpec,
        policy: CapturePolicy,
        *,
        device: torch.device | str | None = None,
        output_spec: OutputSpec | None = None,
        functional: bool = False,
    ) -> None:
        if not isinstance(functional, bool):
            # a truthy non-bool would turn on semantics fn may not have
            raise PolicyError(
                f"GraphedCallable: functional must be True or False, got {functional!r}")
        self._fn = fn
        self._functional = functional
        self._spec = spec
        self._policy = policy
        self._output_spec = output_spec
        self._device = torch.device(device) if device is not None else None
        self.name = policy.name or default_name()
        self.events: list[CaptureEvent] = []
        self.fell_back = False
        self.fallback_reason: str | None = None
        self._counters = CounterNames(self.name)
        self._warned = False
        self._warned_held = False
        self._warned_grad = False
        self._pool: PoolHandle | None = None
        self._ledger: OutputLedger | None = None  # of the pool's static outputs (ledger.py)
        self._n = len(spec.kinds)
        self._slots = Slots(spec, policy)
        self._key = key_function(spec)
        self._copy = _compat.foreach_copy()
        self._ptrs_equal = checked_ptrs_equal()
        self._captures: dict[Key, list[Capture]] = {}
        self._total = 0
        self._released = 0  # captures released as orphaned (_release_orphans)
        self._mirrored: frozenset[int] = frozenset()  # user inputs read through as_strided
        # key -> replay closure of the capture last used for it: the only thing the hot path
        # looks up.
        self._runs: dict[Key, Callable[[Args], object]] = {}
        # each bind()'s replay closures over its held inputs, by the closure they stand in for
        self._bound: weakref.WeakSet[BindVariants] = weakref.WeakSet()
        # keys whose mutated inputs come at a new address on every call (copied_inputs)
        self._copied: dict[Key, CopiedInputs] = {}
        # keys whose every capture was released as orphaned -> their static inputs then new
        # (renewed_statics): the key's next call tells whether they are new on every call
        self._orphaned: dict[Key, dict[int, int]] = {}
        self._lock = threading.RLock()

    def _replay_closure(
        self, cap: Capture, held: tuple[object, ...] | None = None
    ) -> Callable[[Args], object]:
        """The replay closure of ``cap``, generated from its slots' bindings; with ``held``
        (bind), one that takes only the inputs before them."""
        if held is None:
            cap.watched_ptrs = [cap.addresses[i] for i in self._slots.watched]
            cap.plan = self._output_plan(cap)
            cap.watch = cap.plan.watch
        return self._closure(cap, held)

    def _closure(self, cap: Capture, held: tuple[object, ...] | None) -> Callable[[Args], object]:
        copied = self._copied.get(cap.key)
        return replay_closure(self.name, cap, slot_bindings(self._slots, cap, copied), self._slots,
                              self._n, held, self._copy, self._ptrs_equal,
                              self._policy.clone_input, self._changed_constant, copied)

    def _copies(self, cap: Capture) -> bool:
        """Some slot of ``cap`` is COPY_IN_OUT (no bound variant serves it: bind)."""
        return Binding.COPY_IN_OUT in slot_bindings(
            self._slots, cap, self._copied.get(cap.key)).values()

    def _rebind(self, key: Key) -> None:
        """The bindings of ``key``'s slots changed (it copies more inputs, or none): its
        captures' replay closures generated again from them."""
        for cap in self._captures.get(key, []):
            was, cap.replay = cap.replay, self._closure(cap, None)
            if self._runs.get(key) is was:
                self._runs[key] = cap.replay

    def _changed_constant(self, args: Args, constants: tuple[object, ...]) -> None:
        for i, was in zip(self._slots.constant, constants, strict=True):
            if not equal((args[i],), (was,)):
                raise PolicyError(
                    f"{self.name}: constant input {i} is {args[i]!r} but the graph was captured "
                    f"with {was!r}; a replay can only repeat the captured value. Pass values that "
                    "change as ints, floats or bools (SlotKind.SYMBOLIC: one graph per value), "
                    "or call reset()"
                )

    def _another(self, key: Key, args: Args, reason: str, new_tensor: bool = False) -> object:
        """One more capture of ``key`` beside the others, within capture_limit."""
        if self._total < self._policy.capture_limit:
            return self._capture(key, args, reason, new_tensor=new_tensor)
        if reason != HELD_OUTPUTS:
            self._fall_back(CAPTURE_LIMIT)
            return self._fn(*args)
        # Every capture of the key has outputs the caller still holds and no other may be made:
        # this call runs eagerly, so that nothing the caller holds is overwritten.
        self._counters.count_held_eager()
        logger.info("%s: key %s runs eagerly this call (outputs of all its captures held)",
                    self.name, key)
        if not self._warned_held:
            self._warned_held = True
            warn_at_caller(
                f"{self.name}: the outputs of every capture of graph key {key} are still "
                f"referenced and capture_limit={self._policy.capture_limit} allows no other, so "
                "this call (and each such call) runs eagerly instead of overwriting them. Drop "
                "or clone() outputs you keep, use clone_output=True, or raise capture_limit"
            )
        return self._fn(*args)

    def _release_orphans(self) -> list[Capture]:
        """Release the captures of a dropped model (``orphaned_captures``), on the cold path of a
        capture for new static addresses or a new key. force_recapture keeps its captures: its
        replay closure recaptures in place of one. At most capture_limit are released in all:
        a caller passing a fresh tensor as a static input on every call (a temporary) would
        otherwise recapture forever instead of falling back to eager at capture_limit."""
        if (self._policy.force_recapture or not self._captures
                or self._released >= self._policy.capture_limit):
            return []
        gone = orphaned_captures([c for caps in self._captures.values() for c in caps])
        if not gone:
            return []
        runs = {c.replay for c in gone}
        for key in list(self._captures):
            kept = [c for c in self._captures[key] if c not in gone]
            if not kept:
                self._orphaned[key] = renewed_statics(self._captures[key][-1], self._slots.static)
                del self._captures[key]
                self._runs.pop(key, None)
                continue
            self._captures[key] = kept
            if self._runs.get(key) in runs:
                self._runs[key] = kept[-1].replay
        for key in [k for k in self._copied if k not in self._captures]:
            del self._copied[key]
        for variants in self._bound:
            for run in [r for r in variants.by_run if r in runs]:
                del variants.by_run[run]
        self._total -= len(gone)
        self._released += len(gone)
        for cap in gone:
            cap.release()
        self._counters.count_released(len(gone), self._total)
        logger.info("%s: released %d capture(s) whose parameters nothing else holds",
                    self.name, len(gone))
        return gone

    def _capture(
        self, key: Key, args: Args, reason: str, replacing: Capture | None = None,
        new_tensor: bool = False,
    ) -> object:
        """Capture ``key`` (beside its other captures, or replacing ``replacing``) and return the
        call's result.

        A new key is warmed up first and the call returns the last warmup run's result. Any
        other capture is not warmed up again: on an accelerator it replays the fresh capture and
        returns that; where the capture computes (the CPU) the capture's run is the call's. A
        forced one always replays, so force_recapture shows what a fresh capture computes (the
        triage recipe relies on it). A ``functional`` fn's last warmup run is the capture itself
        where the capture computes (see the class docstring)."""
        self._check_kinds(args)
        if _needs_grad(args):  # a key that does not tell (hand-written keys do: _miss)
            self._warn_grad(args)
            self._counters.count_grad_eager()
            return self._fn(*args)
        with collector_paused():  # a collection due would fall into the capture (collector.py)
            device = self._device_for(args)
            start = time.perf_counter()
            # A recapture (held outputs, a new address; of any fn: its key was warmed up
            # already) is the call too, so that fn runs once in it. force_recapture keeps the
            # replay, which is what it shows; its capture then launches no collective
            # (capture.record), as an accelerator's launches nothing, so a call issues each one
            # once on every path.
            if reason == NEW_KEY:
                as_call = self._functional and self._policy.warmup > 0 and capture_runs_fn(device)
            else:
                as_call = reason != FORCE_RECAPTURE and capture_runs_fn(device)
            if as_call:
                if reason == NEW_KEY:
                    undone_runs(self._fn, args, self._slots, self._policy.warmup - 1)
                result = _NO_RESULT
            else:
                result = self._warm_up(args) if reason == NEW_KEY else _NO_RESULT
            cap = self._record(key, args, reason, device, as_call, replacing, new_tensor, start)
            if as_call:
                # the capture's run was this call: its writes stay, its outputs are returned cloned
                assert cap.plan is not None
                return cap.plan.own(args)
            if result is not _NO_RESULT:
                # the warmup's result is the call's, as a replay's would be
                self._ledger_of(device).note_returned([result])
                return result
            result = cap.replay(args)
            if result is MISS:
                raise CaptureError(
                    f"internal: {self.name}'s fresh capture of key {key} refused its call")
            cap.replayed[0] = False  # that replay was this call's own
            return result

    def capture_ahead(self, *args: object) -> bool:
        """Capture the graph key of ``args`` now, for a later call, with no effect the caller
        sees: every warmup run is undone, the capture's own writes are undone (where it
        computes, the CPU) or never run (an accelerator records without running), it launches
        no collective, and nothing is returned or replayed. False, capturing nothing, when the
        key has a capture already, the callable runs eagerly (a fallback, force_eager), the call
        needs autograd, or only one capture is left below capture_limit: that one is a call's,
        so that a capture ahead never makes a call fall back to eager. A later call of the key with the
        same static and mutated addresses replays it.

        What it is for: captures that share a pool made largest first, so that each smaller one
        reuses the blocks the larger ones freed (a caching allocator's graph pool keeps what a
        capture took; made smallest first, the pool becomes their sum)."""
        if len(args) != self._n:
            raise PolicyError(
                f"{self.name}.capture_ahead was called with {len(args)} arguments; its "
                f"InputSpec has {self._n}")
        key = () if self._key is None else self._key(args)
        with self._lock:
            if (key in self._runs or self.fell_back or self._policy.force_eager
                    or (key and key[-1] is NEEDS_GRAD) or _needs_grad(args)):
                return False
            self._release_orphans()
            if self._total + 1 >= self._policy.capture_limit:
                return False  # the last capture capture_limit allows is left for a call
            with collector_paused():  # as in _capture
                self._check_kinds(args)
                self._slots.watch_buffers(args)
                device = self._device_for(args)
                start = time.perf_counter()
                runs = self._policy.warmup
                if self._functional and runs > 0 and capture_runs_fn(device):
                    runs -= 1  # the capture's own run is the last warmup, as on a call (_capture)
                undone_runs(self._fn, args, self._slots, runs)
                self._record(key, args, NEW_KEY, device, False, None, False, start)
                self._counters.count_ahead()
                return True

    def _record(
        self, key: Key, args: Args, reason: str, device: torch.device, as_call: bool,
        replacing: Capture | None, new_tensor: bool, started: float,
    ) -> Capture:
        """Record the capture of ``key`` and file it (beside the key's others, or in place of
        ``replacing``), counted and logged; its run is the call's when ``as_call``. ``started``:
        when the capture's work began (its warm-up runs), for the capture-time counter."""
        statics = _distinct_tensors(args, self._slots.static)
        before = [(sys.getrefcount(args[i]), storage_uses(args[i]))  # type: ignore[arg-type]
                  for i in statics]
        # inputs the capture keeps that are another capture's outputs (graph A's result that
        # graph B updates in place across a graph break): what B keeps, A's captures own
        kept_outputs = [(i, w) for i in _distinct_tensors(args, (*self._slots.static, *self._slots.mutated))
                        if (w := watches_of(args[i]))]  # type: ignore[arg-type]
        kept_before = [references(args[i]) for i, _ in kept_outputs]  # type: ignore[arg-type]
        cap = record(self._fn, self.name, self._spec, self._policy, self._slots, key, args,
                     device, self._pool_for(device), self._replay_closure, as_call,
                     self._mirrored, self._adoptable(reason), new_tensor)
        self._mirrored = cap.mirrored
        caps = self._captures.setdefault(key, [])
        if replacing is not None and replacing in caps:
            caps[caps.index(replacing)] = cap
        else:
            caps.append(cap)
            self._total += 1
        if self._policy.force_recapture:
            self._runs[key] = lambda a: self._capture(key, a, FORCE_RECAPTURE, replacing=cap)
        else:
            self._runs[key] = cap.replay
        # counted before anything is handed out (an output viewing a parameter is the caller's
        # reference) and before the replaced capture lets go of its own
        cap.own_refs = [(i, sys.getrefcount(args[i]) - refs,
                         storage_uses(args[i]) - uses)  # type: ignore[arg-type]
                        for i, (refs, uses) in zip(statics, before, strict=True)]
        kept = [tuple(n - b for n, b in zip(references(args[i]), before_i, strict=True))  # type: ignore[arg-type]
                for (i, _), before_i in zip(kept_outputs, kept_before, strict=True)]
        cap.keeps([owned_by_capture(args[i], counts, w)  # type: ignore[arg-type]
                   for (i, w), counts in zip(kept_outputs, kept, strict=True)])
        if replacing is not None:
            replacing.release()
        self.events.append(CaptureEvent(key, reason))
        self._counters.count_capture(reason, self._total)
        if cap.watch is not None:
            # cyclic garbage the capture made (the frames a caught exception's traceback keeps,
            # a lazy import's) may still reference its outputs: settled with them, the count
            # drops when the collector frees it, and reads as held. All of it is young: the
            # collector is paused during a capture (collector.py), so generation 0 holds
            # everything the capture made, and collecting it alone is cheap
            gc.collect(0)
            cap.watch.settle()  # nothing outside the capture holds its outputs yet
        self._counters.count_capture_time(time.perf_counter() - started)
        logger.info("%s: captured graph key %s (%s)", self.name, key, reason)
        return cap

    def _warn_grad(self, args: Args) -> None:
        logger.info("%s: a call that needs autograd runs eagerly", self.name)
        if self._warned_grad:
            return
        self._warned_grad = True
        i = next((i for i, a in enumerate(args)
                  if isinstance(a, torch.Tensor) and a.requires_grad), None)
        warn_at_caller(
            f"{self.name} was called with grad mode on and input {i} requiring grad: a replay's "
            "outputs have no autograd history (a backward would leave that input's .grad "
            "None), so this call (and each such call) runs fn eagerly. Call it under "
            "torch.no_grad() or torch.inference_mode() to replay"
        )

    def _adoptable(self, reason: str) -> frozenset[int] | None:
        """clone_input=False: what a capture may adopt as its user buffers. A new key's first
        capture adopts the call's tensors; any other capture only those adopted already (what
        the caller passes again), so that a later call's refill never writes a tensor that was
        passed once (another instance's input, another thread's, a result the caller keeps)."""
        if self._policy.clone_input or reason == NEW_KEY:
            return None
        return frozenset(storage_ptr(b) for caps in self._captures.values() for c in caps
                         for b in c.buffers)

    def _warm_up(self, args: Args) -> object:
        runs = self._policy.warmup
        if runs == 0:
            return _NO_RESULT
        return warm_up(self._fn, args, self._slots, runs)

    def _output_plan(self, cap: Capture) -> OutputPlan:
        slots = self._slots
        in_place = {i for i in slots.static + slots.mutated}
        if not self._policy.clone_input:
            in_place.update(i for i in slots.user if i not in cap.mirrored)
        declared = self._output_spec.aliases_input if self._output_spec is not None else ()
        return output_plan(cap.outputs, self.name, cap.args, slots.user, cap.buffers, in_place,
                           declared, self._policy.clone_output, self._ledger_of(cap.graph.device))

    def _ledger_of(self, device: torch.device) -> OutputLedger:
        if self._ledger is None:
            self._ledger = ledger_for(self._pool_for(device))
        return self._ledger


    # ---- fallback, pools, bookkeeping ---------------------------------------------------
    def _fall_back(self, reason: str) -> None:
        self.fell_back = True
        self.fallback_reason = reason
        self._release()
        self._counters.count_fallback(reason)
        if reason != CAPTURE_LIMIT:
            logger.info("%s runs eagerly (%s)", self.name, reason)
            return
        message = (
            f"{self.name}: capture_limit={self._policy.capture_limit} reached (one capture per "
            "graph key and set of static addresses, one more where outputs were held); all its graphs are released and it runs eagerly from now on. "
            "Raise capture_limit, or make fewer inputs dynamic"
        )
        logger.warning("%s", message)
        if not self._warned:
            self._warned = True
            warn_at_caller(message)

    def _release(self) -> None:
        captures = [c for caps in self._captures.values() for c in caps]
        self._runs.clear()
        for variants in self._bound:
            variants.by_run.clear()
        self._captures.clear()
        self._copied.clear()
        self._orphaned.clear()
        self._total = 0
        for cap in captures:
            cap.release()

    def _device_for(self, args: Args) -> torch.device:
        if self._device is None:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            self._device = first.device if first is not None else torch.device("cpu")
        return self._device

    def _pool_for(self, device: torch.device) -> PoolHandle | None:
        choice = self._policy.pool
        if isinstance(choice, str) and choice == "private":
            return None  # each graph gets its own pool
        if self._pool is None:
            self._pool = (
                graph_pool_handle(device) if isinstance(choice, str) else as_pool_handle(choice, device)
            )
        return self._pool

    def _check_kinds(self, args: Args) -> None:
        for i, (kind, a) in enumerate(zip(self._spec.kinds, args, strict=True)):
            if kind in _TENSOR_KINDS and not isinstance(a, torch.Tensor):
                raise PolicyError(
                    f"{self.name}: input {i} is {kind.value} in the InputSpec but is a "
                    f"{type(a).__name__}; pass a tensor or change the spec"
                )
            if kind is SlotKind.SYMBOLIC and not isinstance(a, int | float):
                raise PolicyError(
                    f"{self.name}: input {i} is symbolic in the InputSpec but is a "
                    f"{type(a).__name__}; pass an int, float or bool or change the spec"
                )



ByRun = dict[Callable[[Args], object] | None, Callable[[Args], object]]


class BindVariants:
    """One bind()'s replay closures, by the closure each stands in for; the GraphedCallable
    holds it weakly, so it goes with the bound call that owns it."""

    __slots__ = ("__weakref__", "by_run")

    def __init__(self) -> None:
        self.by_run: ByRun = {}



def _needs_grad(args: Args) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def renewed_statics(c: Capture, static: Sequence[int]) -> dict[int, int]:
    """The static inputs of ``c``, a capture made for a new tensor and released unreplayed as
    orphaned, that nothing else referenced (a buffer re-bound on every call, not the parameters
    that tell another instance apart), with their addresses; {} for any other capture."""
    if not c.new_tensor or c.replayed[0]:
        return {}
    new = {id(c.args[i]) for i in c.orphans}
    return {i: c.addresses[i] for i in static if id(c.args[i]) in new}


def _distinct_tensors(args: Args, indices: Sequence[int]) -> list[int]:
    """The indices of the tensors among ``args[indices]``, each tensor object once."""
    seen: set[int] = set()
    out = []
    for i in indices:
        a = args[i]
        if isinstance(a, torch.Tensor) and id(a) not in seen:
            seen.add(id(a))
            out.append(i)
    return out
