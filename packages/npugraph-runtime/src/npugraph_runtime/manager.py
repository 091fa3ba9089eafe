"""The capture manager: GraphedCallable and make_graphed_callable.

A GraphedCallable owns every capture of one callable. The first call for a graph key warms up
and captures; every later call runs one precomputed closure for its key: check the addresses the
capture depends on, copy the user inputs into the capture's buffers, replay, return the outputs.
Everything else is decided at capture time: capture.py makes a capture, selection.py picks
which capture of a key serves a call its last one could not replay, outputs.py plans what a
replay returns."""

from __future__ import annotations

import dataclasses
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from npugraph_runtime import _compat
from npugraph_runtime.bindings import MISS, checked_ptrs_equal, equal, replay_closure, slot_bindings
from npugraph_runtime.callsite import warn_at_caller
from npugraph_runtime.capture import (
    Capture,
    Slots,
    capture_runs_fn,
    orphaned_captures,
    record,
    storage_uses,
    tensor,
    undone_runs,
    warm_up,
)
from npugraph_runtime.copied_inputs import CopiedInputs
from npugraph_runtime.core_limit import capture_core_limit
from npugraph_runtime.counters import (
    CAPTURE_LIMIT,
    FORCE_EAGER,
    FORCE_RECAPTURE,
    HELD_OUTPUTS,
    MUTATED_INPUT_CHANGE,
    NEW_KEY,
    STATIC_INPUT_CHANGE,
    CaptureEvent,
    CounterNames,
    default_name,
    logger,
)
from npugraph_runtime.devices.base import DeviceGraph, PoolHandle
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
from npugraph_runtime.selection import choose
from npugraph_runtime.spec import CapturePolicy, InputSpec, OutputSpec, SlotKind

__all__ = ["CaptureEvent", "GraphedCallable", "make_graphed_callable"]

_data_ptr = torch.Tensor.data_ptr
_NO_RESULT: Any = object()
_TENSOR_KINDS = (SlotKind.STATIC, SlotKind.MUTATED, SlotKind.USER)


class GraphedCallable:
    """Captures ``fn`` into device graphs, one per graph key, and replays them.

    ``fn`` is called positionally with the same arguments as this object. The caller
    guarantees what the spec says: static inputs keep their contents between calls, mutated
    inputs are the only tensors ``fn`` updates in place, every tensor keeps its dtype and device
    (hand-written capture keys them), the dims of a tensor that are not keyed keep their sizes,
    a static or mutated tensor at its captured address keeps its strides (only the address is
    checked), user inputs share no memory with mutated inputs on later calls either (checked at
    capture only), and constant inputs do not change (checked every call).

    The addresses of static inputs select the capture: one FX graph serves every instance of a
    module class, so each distinct set of static addresses gets its own capture of the key,
    kept beside the others (up to ``capture_limit``). With ``check_static_addresses=False`` only
    the first and the last static input's addresses are checked (the representatives of an
    instance), with every static input that is not an ``nn.Parameter`` (a buffer a forward may
    re-bind): a re-bound parameter between them goes unnoticed, and so do instances that
    share both (a class-attribute tensor used first and a shared submodule used last). Mutated inputs' addresses select the
    capture too while the caller keeps the earlier tensors (requests with their own KV caches);
    a capture whose mutated tensors the caller dropped is the one replaced.

    With ``clone_output=False`` the returned tensors are the graph's static outputs, and a replay
    never changes a value the caller still holds: when a capture's outputs (or views of them)
    are still referenced at its next replay, another capture of the key with its own output
    memory replays instead (made once, reason ``held_outputs``; a decode loop alternates between
    two). At ``capture_limit`` such a call runs eagerly instead (counted, one warning).
    With ``clone_input=False`` the first call's user tensors become the capture's buffers and a
    later call at another address overwrites them (a call whose inputs overlap them raises
    PolicyError instead); a user tensor that shares memory with another input, or overlaps
    itself, gets an owned buffer, and so does one the graph reads through as_strided (its buffer
    mirrors the caller's whole storage, copied every call). Outputs that view a user input are
    views of the caller's tensor, as in eager.

    Threads: one call at a time per GraphedCallable (a lock around each call); a call's results
    stay intact while another thread's calls run, by the rule above.
    Refused at capture (PolicyError): fn writing a user or static input in place (declare it
    mutated), and a user input sharing bytes with a mutated input (a disjoint view of the same
    storage is fine, unless the graph reads it through as_strided).

    ``functional=True`` says ``fn`` is a traced graph (the backend's): it runs the same ops on
    every call and writes nothing but its mutated inputs. On a device whose capture computes (the
    CPU) the last warmup run of a new key is then the capture itself: its writes to the mutated
    inputs stay and the call returns clones of its outputs, so the graph runs once, not twice.
    There, any later capture of a key but a forced one (of any fn) is the call's run in the same
    way, so that fn's collectives run once a call, as on an accelerator."""

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
        self._bound: weakref.WeakSet[_Variants] = weakref.WeakSet()
        # keys whose mutated inputs come at a new address on every call (copied_inputs)
        self._copied: dict[Key, CopiedInputs] = {}
        # keys whose every capture was released as orphaned -> their static inputs then new
        # (_renewed): the key's next call tells whether they are new on every call
        self._orphaned: dict[Key, dict[int, int]] = {}
        self._lock = threading.RLock()

    # ---- the hot path -------------------------------------------------------------------
    def __call__(self, *args: object) -> object:
        if len(args) != self._n:
            raise PolicyError(
                f"{self.name} was called with {len(args)} arguments; its InputSpec has {self._n}"
            )
        try:
            key = () if self._key is None else self._key(args)
        except (AttributeError, IndexError, TypeError):
            self._check_kinds(args)  # names the input of the wrong type
            raise
        with self._lock:
            run = self._runs.get(key)
            if run is None:
                return self._miss(key, args)
            out = run(args)
            if out is MISS:
                return self._reselect(key, args, run)
            return out

    def bind(self, held: Sequence[object]) -> Callable[[Args], object] | None:
        """This callable with its last ``len(held)`` inputs always ``held`` (a model's parameters,
        as the cache's serving plan holds them): the bound call takes the leading inputs only, so
        no call builds or re-picks the whole argument tuple, and the held inputs' addresses are
        checked over the held objects themselves (a ``.data`` swap is still seen). None unless
        every held input is static. A call its key's current capture cannot serve (new key,
        other addresses, held outputs, a fallback) takes the general path,
        ``self(*call, *held)``."""
        held = tuple(held)
        n0 = self._n - len(held)
        if not held or n0 < 0 or any(k is not SlotKind.STATIC for k in self._spec.kinds[n0:]):
            return None
        variants = _Variants()
        self._bound.add(variants)  # _release empties it with the captures
        key_of, runs, lock, by_run = self._key, self._runs, self._lock, variants.by_run

        def bound(call: Args) -> object:
            if len(call) == n0:
                with lock:
                    try:
                        key = () if key_of is None else key_of(call)
                    except (AttributeError, IndexError, TypeError):
                        return self(*call, *held)  # names the input of the wrong type
                    run = by_run.get(runs.get(key))
                    if run is not None:
                        out = run(call)
                        if out is not MISS:
                            return out
                    out = self(*call, *held)
                    self._follow(variants.by_run, key, held)  # keeps variants alive
                    return out
            return self(*call, *held)  # raises, naming the count

        return bound

    def _follow(self, variants: _ByRun, key: Key, held: tuple[object, ...]) -> None:
        """After a general call: ``variants`` has a bound closure for the key's current capture,
        and none for a capture that is gone."""
        live = {c.replay: c for c in self._captures.get(key, [])}
        for run in [r for r in variants if r not in live]:
            del variants[run]
        current = self._runs.get(key)
        if current in live and current not in variants:
            variants[current] = self._replay_closure(live[current], held)

    def _replay_closure(
        self, cap: Capture, held: tuple[object, ...] | None = None
    ) -> Callable[[Args], object]:
        """The replay closure of ``cap``, generated from its slots' bindings; with ``held``
        (bind), one that takes only the inputs before them."""
        if held is None:
            cap.watched_ptrs = [cap.addresses[i] for i in self._slots.watched]
            cap.plan = self._output_plan(cap)
            cap.watch = cap.plan.watch
        return replay_closure(self.name, cap, slot_bindings(self._slots, cap), self._slots, self._n,
                              held,
                              self._copy, self._ptrs_equal, self._policy.clone_input,
                              self._changed_constant)

    def _changed_constant(self, args: Args, constants: tuple[object, ...]) -> None:
        for i, was in zip(self._slots.constant, constants, strict=True):
            if not equal((args[i],), (was,)):
                raise PolicyError(
                    f"{self.name}: constant input {i} is {args[i]!r} but the graph was captured "
                    f"with {was!r}; a replay can only repeat the captured value. Pass values that "
                    "change as ints, floats or bools (SlotKind.SYMBOLIC: one graph per value), "
                    "or call reset()"
                )

    def _reselect(self, key: Key, args: Args, tried: Callable[[Args], object]) -> object:
        """The key's last capture (``tried``) cannot replay this call (other addresses, another
        core limit, or its outputs are still held): replay another capture of the key that can,
        or make one."""
        caps = self._captures[key]
        for c in caps:
            if c.replay is not tried:
                out = c.replay(args)
                if out is not MISS:
                    self._runs[key] = c.replay
                    return out
        choice = choose(self.name, self._slots, caps, args, capture_core_limit(),
                        self._total < self._policy.capture_limit)
        gone = choice.replacing
        # (while the key copies some inputs, others may be new on every call too: _copy_more)
        new_tensor = (choice.reason in (MUTATED_INPUT_CHANGE, STATIC_INPUT_CHANGE)
                      and not self._policy.force_recapture)
        if gone is None:
            if choice.reason == STATIC_INPUT_CHANGE:  # another model: is an earlier one gone?
                released = self._release_orphans()
                renewed = next((r for c in released if c.key == key
                                and (r := _renewed(c, self._slots.static))), None)
                if renewed and new_tensor:
                    # a static input (a buffer the forward re-binds, ``self.steps =
                    # self.steps + 1``) that is new on every call: read from a buffer of the
                    # key's own, refilled before each replay
                    out = self._copy_statics(key, args, renewed)
                    if out is not MISS:
                        return out
            return self._another(key, args, choice.reason, new_tensor)
        if new_tensor and gone.new_tensor and not gone.replayed[0] and gone.dropped():
            # a capture made for a new tensor, dropped before any later call replayed it: this
            # input is new on every call, and each call would capture
            churned = gone.let_go()
            copied = self._copied.get(key)
            if copied is not None:
                out = self._copy_more(key, args, copied, churned, written=True, replacing=gone)
                if out is not MISS:
                    return out
            elif CopiedInputs.eligible(churned, args):
                return self._start_copying(key, args, CopiedInputs(churned, args, churned))
        return self._capture(key, args, choice.reason, replacing=gone, new_tensor=new_tensor)

    def _copy_statics(self, key: Key, args: Args, renewed: dict[int, int]) -> object:
        """Copy the static inputs of ``renewed`` (see _renewed) that this call passes anew, if
        they can be (beside those the key copies already); else MISS."""
        churned = [i for i, ptr in renewed.items() if tensor(args, i).data_ptr() != ptr]
        copied = self._copied.get(key)
        if copied is not None:
            return self._copy_more(key, args, copied, churned)
        if not CopiedInputs.eligible(churned, args):
            return MISS
        return self._start_copying(key, args, CopiedInputs(churned, args))

    def _copy_more(self, key: Key, args: Args, copied: CopiedInputs, churned: list[int],
                   written: bool = False, replacing: Capture | None = None) -> object:
        """The key copies some inputs already (``args`` hold its buffers): copy ``churned`` too
        (``written``: mutated ones, copied back), and capture over them; MISS where they cannot
        be. A layer's re-bound buffer beside the other graph's result it updates in place."""
        churned = [i for i in churned if i not in copied.slots]
        if not CopiedInputs.eligible(churned, args):
            return MISS
        copied.add(churned, args, written)
        sub = copied.substitute(args)
        self._copy([tensor(sub, i) for i in churned], [tensor(args, i) for i in churned])
        self._counters.count_copied(len(churned))
        if replacing is not None:
            return self._capture(key, sub, MUTATED_INPUT_CHANGE, replacing=replacing)
        return self._another(key, sub, STATIC_INPUT_CHANGE)

    def _start_copying(self, key: Key, args: Args, copied: CopiedInputs) -> object:
        """From now on ``key``'s calls copy those inputs into buffers of the key's own (and the
        mutated ones back: copied_inputs), so that its capture over the buffers replays."""
        self._copied[key] = copied
        copied.inner = self._runs.get(key)
        run = self._copied_run(key, copied)
        self._runs[key] = run
        self._counters.count_copied(len(copied.slots))
        logger.info("%s: key %s copies input(s) %s on every call (a new tensor on every call)",
                    self.name, key, copied.slots)
        return run(args)

    def _copied_run(self, key: Key, copied: CopiedInputs) -> Callable[[Args], object]:
        copy = self._copy

        def run(args: Args) -> object:
            if not copied.fits(args):  # another layout, a view: the address rules again
                self._stop_copying(key, copied)
                return self._reselect(key, args, run)
            sources = copied.sources(args)
            # a request's cache: its own capture, no copies; not where the tensors the caller
            # keeps in turn are more than capture_limit allows captures (each call would capture)
            if copied.lives(sources) and (
                    self._total + copied.live() < self._policy.capture_limit):
                self._stop_copying(key, copied)
                return self._reselect(key, args, run)
            copy(copied.buffers, sources)
            sub = copied.substitute(args)
            inner = copied.inner
            out = inner(sub) if inner is not None else MISS
            if out is MISS:
                if self._captures.get(key):
                    out = self._reselect(key, sub, inner if inner is not None else run)
                else:  # every capture of the key was released (its static inputs dropped)
                    out = self._another(key, sub, STATIC_INPUT_CHANGE)
                if self._copied.get(key) is copied:  # not released (a fallback) meanwhile
                    latest = self._runs.get(key)
                    copied.inner = latest if latest is not run else None
                    self._runs[key] = run
                sources = copied.sources(args)  # with any input it copies from now on
            if copied.written:
                copy([sources[k] for k in copied.written], copied.written_buffers)
            return copied.remap(out, sources)

        return run

    def _stop_copying(self, key: Key, copied: CopiedInputs) -> None:
        if self._copied.get(key) is not copied:
            return
        del self._copied[key]
        inner = copied.inner
        if inner is not None:
            self._runs[key] = inner
        else:
            self._runs.pop(key, None)

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

    # ---- capture ------------------------------------------------------------------------
    def _miss(self, key: Key, args: Args) -> object:
        if self.fell_back:
            return self._fn(*args)
        if key and key[-1] is NEEDS_GRAD:
            # this key's calls need autograd: they run eagerly from now on, never captured
            def eager(a: Args) -> object:
                self._counters.count_grad_eager()
                return self._fn(*a)

            self._runs[key] = eager
            self._warn_grad(args)
            return eager(args)
        if self._policy.force_eager:
            self._fall_back(FORCE_EAGER)
            return self._fn(*args)
        self._release_orphans()
        if self._total >= self._policy.capture_limit:
            self._fall_back(CAPTURE_LIMIT)
            return self._fn(*args)
        self._slots.watch_buffers(args)  # before any replay closure reads the watched inputs
        renewed = self._orphaned.pop(key, None)
        if renewed is not None and not self._policy.force_recapture:
            # every capture of this key was released, its static inputs dropped (another key's
            # call found them so: dynamic shapes, a buffer re-bound on every call)
            out = self._copy_statics(key, args, renewed)
            if out is not MISS:
                return out
            # as new (a swapped model's key warms up again), noting whether a call replays it
            return self._capture(key, args, NEW_KEY, new_tensor=True)
        return self._capture(key, args, NEW_KEY)

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
                self._orphaned[key] = _renewed(self._captures[key][-1], self._slots.static)
                del self._captures[key]
                self._runs.pop(key, None)
                continue
            self._captures[key] = kept
            if self._runs.get(key) in runs:
                self._runs[key] = kept[-1].replay
            copied = self._copied.get(key)
            if copied is not None and copied.inner in runs:
                copied.inner = kept[-1].replay
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
        device = self._device_for(args)
        # A recapture (held outputs, a new address; of any fn: its key was warmed up already) is
        # the call too, so that fn runs once in it. force_recapture keeps the replay, which is
        # what it shows; its capture then launches no collective (capture.record), as an
        # accelerator's launches nothing, so a call issues each one once on every path.
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
        logger.info("%s: captured graph key %s (%s)", self.name, key, reason)
        if cap.watch is not None:
            cap.watch.settle()  # nothing outside the capture holds its outputs yet
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
            raise CaptureError(f"internal: {self.name}'s fresh capture of key {key} refused its call")
        cap.replayed[0] = False  # that replay was this call's own
        return result

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

    def reset(self) -> None:
        """Release every graph; the next call of each key captures again."""
        with self._lock:
            self._release()
            self._released = 0
            self._pool = None
            self.fell_back = False
            self.fallback_reason = None
            self._counters.count_reset()

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

    @property
    def num_captures(self) -> int:
        """Captures held now, every capture of every key counted."""
        return self._total

    @property
    def graphs(self) -> dict[Key, DeviceGraph]:
        """The first capture of each key (see ``captures`` for all of them)."""
        return {k: caps[0].graph for k, caps in self._captures.items()}

    @property
    def captures(self) -> dict[Key, list[DeviceGraph]]:
        """Every capture of each key: one per distinct set of static addresses, and more where
        the caller held outputs."""
        return {k: [c.graph for c in caps] for k, caps in self._captures.items()}

    @property
    def policy(self) -> CapturePolicy:
        return self._policy

    @property
    def spec(self) -> InputSpec:
        return self._spec

    def __repr__(self) -> str:
        return (
            f"GraphedCallable({self.name!r}, captures={self._total}, "
            f"fell_back={self.fell_back})"
        )


_ByRun = dict[Callable[[Args], object] | None, Callable[[Args], object]]


class _Variants:
    """One bind()'s replay closures, by the closure each stands in for; the GraphedCallable
    holds it weakly, so it goes with the bound call that owns it."""

    __slots__ = ("__weakref__", "by_run")

    def __init__(self) -> None:
        self.by_run: _ByRun = {}


def _needs_grad(args: Args) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _renewed(c: Capture, static: Sequence[int]) -> dict[int, int]:
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


_POLICY_NAMES = tuple(f.name for f in dataclasses.fields(CapturePolicy))


def make_graphed_callable(
    fn: Callable[..., object],
    example_inputs: Sequence[object],
    static_argnums: Sequence[int] = (),
    mutated_argnums: Sequence[int] = (),
    *,
    device: torch.device | str | None = None,
    **policies: Any,
) -> GraphedCallable:
    """A GraphedCallable for hand-written capture. Tensors are user inputs unless listed in
    ``static_argnums`` (never copied: the caller keeps them at one address, e.g. parameters) or
    ``mutated_argnums`` (updated in place by ``fn``, e.g. a KV cache); ints, floats and bools
    key the graph (one capture per value); other non-tensors must not change between calls; every
    dim of a user or mutated tensor keys the graph. ``policies`` are CapturePolicy fields.
    Nothing is captured until the first call."""
    unknown = sorted(set(policies) - set(_POLICY_NAMES))
    if unknown:
        raise PolicyError(
            f"unknown capture policy {', '.join(unknown)}; allowed: {', '.join(_POLICY_NAMES)}"
        )
    spec = InputSpec.infer(example_inputs, static_argnums, mutated_argnums)
    policy = CapturePolicy(**policies)
    if device is None:
        first = next((x for x in example_inputs if isinstance(x, torch.Tensor)), None)
        device = first.device if first is not None else None
    return GraphedCallable(fn, spec, policy, device=device)
