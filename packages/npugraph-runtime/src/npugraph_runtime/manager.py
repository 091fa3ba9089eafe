"""The capture manager: GraphedCallable and make_graphed_callable.

A GraphedCallable owns every capture of one callable. The first call for a graph key warms up
and captures; every later call runs one precomputed closure for its key: check the addresses the
capture depends on, copy the user inputs into the capture's buffers, replay, return the outputs.
Everything else is decided at capture time."""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from npugraph_runtime import _compat
from npugraph_runtime.callsite import warn_at_caller
from npugraph_runtime.core_limit import current_core_limit
from npugraph_runtime.counters import (
    CAPTURE_LIMIT,
    CORE_LIMIT_CHANGE,
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
from npugraph_runtime.graphs import Graph, as_pool_handle, graph, graph_pool_handle
from npugraph_runtime.inputs import (
    WriteWatch,
    bytes_overlap,
    mirror,
    mirror_filler,
    non_overlapping,
    refiller,
    storage_ptr,
)
from npugraph_runtime.keys import Args, Key, key_function, picker
from npugraph_runtime.outputs import Holds, OutputPlan, output_plan
from npugraph_runtime.spec import CapturePolicy, InputSpec, OutputSpec, SlotKind

__all__ = ["CaptureEvent", "GraphedCallable", "make_graphed_callable"]

_data_ptr = torch.Tensor.data_ptr
_NO_RESULT: Any = object()
# what a replay closure returns when its capture cannot serve the call (other addresses,
# another core limit, outputs still held): the caller then looks for another capture
_MISS: Any = object()
_TENSOR_KINDS = (SlotKind.STATIC, SlotKind.MUTATED, SlotKind.USER)


# Profiler range names (what a trace shows); the backend's compile phases use the same prefix.
REPLAY_RANGE = "npugraph_ex::replay"
CAPTURE_RANGE = "npugraph_ex::capture"


class _Capture:
    """One captured graph and what its replay closure needs kept alive."""

    __slots__ = ("addresses", "args", "buffers", "callers", "core_limit", "graph", "holds", "key",
                 "mirrored", "outputs", "plan", "replay", "watched_ptrs")

    def __init__(
        self, key: Key, graph: DeviceGraph, args: list[object], buffers: list[torch.Tensor],
        mirrored: frozenset[int],
    ) -> None:
        self.key = key
        self.graph = graph
        self.args = args  # what the graph saw: static/mutated inputs in place, user buffers
        self.buffers = buffers
        self.mirrored = mirrored  # user inputs whose buffer mirrors the caller's whole storage
        # input index -> data_ptr at capture, for the inputs the graph uses in place
        self.addresses = {
            i: a.data_ptr() for i, a in enumerate(args) if isinstance(a, torch.Tensor)
        }
        self.watched_ptrs: list[int] = []
        # the caller's mutated tensors, weakly: the capture itself holds aliases of them
        self.callers: list[weakref.ref[torch.Tensor]] = []
        self.core_limit = current_core_limit()
        self.outputs: object = None
        self.holds: Holds | None = None
        self.plan: OutputPlan | None = None
        self.replay: Callable[[Args], object] = _unset

    def dropped(self) -> bool:
        """The caller let go of a mutated tensor of this capture (a finished request's cache):
        nothing can call it with those addresses again, so it is the one to replace."""
        return any(ref() is None for ref in self.callers)

    def fits(self, args: Args, watched: Sequence[int]) -> bool:
        """The addresses the replay closure checks are the ones this call passes."""
        return [_data_ptr(args[i]) for i in watched] == self.watched_ptrs  # type: ignore[arg-type]


def _unset(args: Args) -> object:
    raise CaptureError("internal: a capture's replay closure was used before it was built")


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
    the first static input's address is checked (one representative per instance): a re-bound
    static input other than the first goes unnoticed. Mutated inputs' addresses select the
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
    storage is fine, unless the graph reads it through as_strided)."""

    def __init__(
        self,
        fn: Callable[..., object],
        spec: InputSpec,
        policy: CapturePolicy,
        *,
        device: torch.device | str | None = None,
        output_spec: OutputSpec | None = None,
    ) -> None:
        self._fn = fn
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
        self._pool: PoolHandle | None = None
        self._n = len(spec.kinds)
        kinds = spec.kinds
        self._user = [i for i, k in enumerate(kinds) if k is SlotKind.USER]
        self._mutated = [i for i, k in enumerate(kinds) if k is SlotKind.MUTATED]
        self._static = [i for i, k in enumerate(kinds) if k is SlotKind.STATIC]
        self._constant = [i for i, k in enumerate(kinds) if k is SlotKind.CONSTANT]
        # Inputs the graph uses in place whose address the replay path checks.
        checked_static = self._static if policy.check_static_addresses else self._static[:1]
        self._watched = sorted(self._mutated + checked_static)
        self._key = key_function(spec)
        self._copy = _compat.foreach_copy()
        self._ptrs_equal = _checked_ptrs_equal()
        self._captures: dict[Key, list[_Capture]] = {}
        self._total = 0
        # key -> replay closure of the capture last used for it: the only thing the hot path
        # looks up.
        self._runs: dict[Key, Callable[[Args], object]] = {}
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
            if out is _MISS:
                return self._reselect(key, args, run)
            return out

    def _replay_closure(self, cap: _Capture) -> Callable[[Args], object]:
        replay = cap.graph.replay
        core_limit, captured_limit = current_core_limit, cap.core_limit
        # Inputs the graph uses in place: their addresses at capture, checked in one C++ call
        # where torch has one, else in one pass of data_ptr (~55 ns a tensor).
        watched = self._watched
        cap.watched_ptrs = watched_ptrs = [cap.addresses[i] for i in watched]
        pick_watched = picker(watched)
        all_equal = self._ptrs_equal if watched else None
        by_slot: list[int | None] = [cap.addresses.get(i) if i in watched else None
                                     for i in range(self._n)]
        plain_slots = [i for i in self._user if i not in cap.mirrored]
        pick_user = picker(plain_slots)
        buffers = [b for i, b in zip(self._user, cap.buffers, strict=True) if i not in cap.mirrored]
        copy = self._copy
        always_copy = self._policy.clone_input  # owned buffers never equal a caller's tensor
        unchanged, refill = refiller(buffers, copy, plain_slots)
        mirrored = sorted(cap.mirrored)
        pick_mirrored = picker(mirrored)
        fill_mirrors = mirror_filler(
            [cap.buffers[self._user.index(i)] for i in mirrored], mirrored, self.name)
        cap.plan = plan = self._output_plan(cap)
        result, build, holds = plan.result, plan.build, plan.holds
        cap.holds = holds
        # What tells whether the caller still holds the previous replay's outputs (outputs.py)
        held_objects = holds.objects if holds is not None else None
        held_storages = holds.cdatas if holds is not None else []
        refcount, use_count = sys.getrefcount, _compat.storage_use_count()
        data_ptr = _data_ptr
        pick_constants = picker(self._constant)
        constants = pick_constants(tuple(cap.args)) if pick_constants is not None else ()
        changed_constant = self._changed_constant

        profiling = _compat.profiler_enabled

        def run(args: Args) -> object:
            if profiling():
                return profiled(args)
            return plain(args)

        def profiled(args: Args) -> object:
            with torch.profiler.record_function(REPLAY_RANGE):
                return plain(args)

        def plain(args: Args) -> object:
            if pick_constants is not None and not _equal(pick_constants(args), constants):
                changed_constant(args, constants)
            if core_limit() != captured_limit:
                return _MISS
            # the caller still holds the previous replay's outputs: checked first, it is the
            # cheap test that makes a decode loop move to the other capture of the key
            if held_objects is not None and (
                list(map(refcount, held_objects)), list(map(use_count, held_storages))
            ) != holds.base:  # type: ignore[union-attr]
                return _MISS
            if all_equal is not None:
                if not all_equal(list(args), by_slot, watched):
                    return _MISS
            elif pick_watched is not None and list(map(data_ptr, pick_watched(args))) != watched_ptrs:  # type: ignore[arg-type]
                return _MISS
            if pick_user is not None:
                sources = pick_user(args)
                if always_copy:
                    copy(buffers, sources)  # type: ignore[arg-type]
                elif not unchanged(sources):  # type: ignore[arg-type]
                    refill(sources)  # type: ignore[arg-type]
            if pick_mirrored is not None:
                fill_mirrors(pick_mirrored(args))  # type: ignore[arg-type]
            replay()
            return result if build is None else build(args)

        return run

    def _changed_constant(self, args: Args, constants: tuple[object, ...]) -> None:
        for i, was in zip(self._constant, constants, strict=True):
            if not _equal((args[i],), (was,)):
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
                if out is not _MISS:
                    self._runs[key] = c.replay
                    return out
        limit = current_core_limit()
        watched = self._watched
        if any(c.core_limit == limit and c.fits(args, watched) for c in caps):
            return self._another(key, args, HELD_OUTPUTS)
        self._same_layouts(args, caps[0])
        statics = [i for i in watched if i not in self._mutated]
        same_statics = [c for c in caps if all(
            _data_ptr(args[i]) == c.addresses[i] for i in statics)]  # type: ignore[arg-type]
        old = next((c for c in same_statics if c.core_limit == limit), None)
        if old is not None:
            # other mutated tensors (another request's KV cache): a capture beside the others,
            # so requests served in turn replay their own; one whose tensors the caller dropped
            # is replaced, and so is the first at capture_limit
            gone = next((c for c in same_statics if c.core_limit == limit and c.dropped()), None)
            if gone is None and self._total < self._policy.capture_limit:
                return self._capture(key, args, MUTATED_INPUT_CHANGE)
            return self._capture(key, args, MUTATED_INPUT_CHANGE, replacing=gone or old)
        old = next((c for c in same_statics if c.fits(args, watched)), None)
        if old is not None:
            return self._capture(key, args, CORE_LIMIT_CHANGE, replacing=old)
        return self._another(key, args, STATIC_INPUT_CHANGE)

    def _same_layouts(self, args: Args, first: _Capture) -> None:
        """A static or mutated input at a new address must have the layout the graph was made
        for: a graph traced for one shape replayed (or captured) on another gives wrong numbers
        or crashes, and under cache_compile's serving path no guard of torch's checks a
        parameter's shape on every call."""
        for i in (*self._static, *self._mutated):
            new, was = args[i], first.args[i]
            if not isinstance(new, torch.Tensor) or not isinstance(was, torch.Tensor):
                continue
            got = (tuple(new.shape), new.stride(), new.dtype, new.device)
            want = (tuple(was.shape), was.stride(), was.dtype, was.device)
            if got != want:
                kind = "mutated" if i in self._mutated else "static"
                raise PolicyError(
                    f"{self.name}: {kind} input {i} (a parameter, buffer or cache) was re-bound to "
                    f"a tensor of shape {got[0]}, stride {got[1]}, {got[2]} on {got[3]}, but the "
                    f"graph was made for shape {want[0]}, stride {want[1]}, {want[2]} on "
                    f"{want[3]}. Re-bind it to a tensor of the same layout (copy_ into it), or "
                    "compile again for the new layout"
                )

    def _another(self, key: Key, args: Args, reason: str) -> object:
        """One more capture of ``key`` beside the others, within capture_limit."""
        if self._total < self._policy.capture_limit:
            return self._capture(key, args, reason)
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
        if self._policy.force_eager:
            self._fall_back(FORCE_EAGER)
            return self._fn(*args)
        if self._total >= self._policy.capture_limit:
            self._fall_back(CAPTURE_LIMIT)
            return self._fn(*args)
        return self._capture(key, args, NEW_KEY)

    def _capture(
        self, key: Key, args: Args, reason: str, replacing: _Capture | None = None
    ) -> object:
        """Capture ``key`` (beside its other captures, or replacing ``replacing``) and return the
        call's result.

        A new key is warmed up first and the call returns the last warmup run's result. Any
        other capture is not warmed up again: it replays the fresh capture and returns that, so
        force_recapture shows what a fresh capture computes (the triage recipe relies on it)."""
        self._check_kinds(args)
        result = self._warm_up(args) if reason == NEW_KEY else _NO_RESULT
        cap = self._record(key, args)
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
        if replacing is not None:
            replacing.graph.reset()
        self.events.append(CaptureEvent(key, reason))
        self._counters.count_capture(reason, self._total)
        logger.info("%s: captured graph key %s (%s)", self.name, key, reason)
        if cap.holds is not None:
            cap.holds.settle()  # nothing outside the capture holds its outputs yet
        if result is not _NO_RESULT:
            return result
        result = cap.replay(args)
        if result is _MISS:
            raise CaptureError(f"internal: {self.name}'s fresh capture of key {key} refused its call")
        return result

    def _warm_up(self, args: Args) -> object:
        runs = self._policy.warmup
        if runs == 0:
            return _NO_RESULT
        if runs > 1:
            # Every run but the last is undone, so side effects land once, as in eager.
            mutated: list[torch.Tensor] = [args[i] for i in self._mutated]  # type: ignore[misc]
            snapshot = [t.clone() for t in mutated]
            for _ in range(runs - 1):
                self._fn(*args)
                for t, s in zip(mutated, snapshot, strict=True):
                    t.copy_(s)
        return self._fn(*args)

    def _record(self, key: Key, args: Args) -> _Capture:
        """Capture once; again, with mirrored buffers, when the graph turns out to read a user
        input through as_strided (at storage positions a dense buffer does not have)."""
        mirrored: frozenset[int] = frozenset()
        while True:
            g, out, cap_args, buffers, raw_reads = self._record_once(args, mirrored)
            if raw_reads <= mirrored:
                break
            g.reset()
            mirrored |= raw_reads
        cap = _Capture(key, g, cap_args, buffers, mirrored)
        cap.callers = [weakref.ref(args[i]) for i in self._mutated]  # type: ignore[arg-type]
        cap.outputs = out
        try:
            cap.replay = self._replay_closure(cap)
        except BaseException:
            g.reset()
            raise
        return cap

    def _record_once(
        self, args: Args, mirrored: frozenset[int]
    ) -> tuple[DeviceGraph, object, list[object], list[torch.Tensor], frozenset[int]]:
        device = self._device_for(args)
        cap_args, buffers = self._buffers(args, mirrored)
        # statics and user buffers must not be written: replays would not write the caller's
        # tensor (user) or would repeat the write warmups already made (static)
        mutated = {storage_ptr(args[i]) for i in self._mutated}  # type: ignore[arg-type]
        users = {storage_ptr(b): i for i, b in zip(self._user, buffers, strict=True)}
        watched = dict(users)
        for i in self._static:
            watched.setdefault(storage_ptr(args[i]), i)  # type: ignore[arg-type]
        watch = WriteWatch({p: i for p, i in watched.items() if p and p not in mutated},
                           {p: i for p, i in users.items() if p})
        g = Graph(device)
        with (
            torch.profiler.record_function(CAPTURE_RANGE),
            graph(g, pool=self._pool_for(device), capture_error_mode=self._policy.capture_error_mode),
            watch,
        ):
            out = self._fn(*cap_args)
        if watch.written:
            g.reset()
            i, op = next(iter(watch.written.items()))
            raise PolicyError(
                f"{self.name}: fn writes input {i} in place ({op}), but the InputSpec makes it "
                f"{self._spec.kinds[i].value}: a replay would not write the caller's tensor like "
                "eager does. Declare it mutated (make_graphed_callable(mutated_argnums=...), "
                "SlotKind.MUTATED) or do not write it"
            )
        return g, out, cap_args, buffers, frozenset(watch.raw_reads)

    def _buffers(
        self, args: Args, mirrored: frozenset[int] = frozenset()
    ) -> tuple[list[object], list[torch.Tensor]]:
        """The arguments a capture runs on and its user-input buffers. A buffer is the caller's
        own tensor only under clone_input=False, and only when no other input shares its memory
        and no two of its elements overlap; otherwise it is an owned copy with the caller's
        layout (made dense), so that refilling it never writes memory another input (or another
        element) is read from. A ``mirrored`` input's buffer copies the caller's whole storage
        at the caller's offset and strides (the graph reads it through as_strided)."""
        mutated = {storage_ptr(args[i]): i for i in self._mutated}  # type: ignore[arg-type]
        for i in self._user:
            # a user input read through as_strided may reach any byte of its storage; another
            # one only its own bytes, so a disjoint view of a mutated input's storage is fine
            j = next((j for j in self._mutated if (
                storage_ptr(args[i]) == storage_ptr(args[j])  # type: ignore[arg-type]
                and (i in mirrored or bytes_overlap(args[i], args[j])))), None)  # type: ignore[arg-type]
            if j is not None and args[i].numel():  # type: ignore[attr-defined]
                raise PolicyError(
                    f"{self.name}: user input {i} shares memory with mutated input {j}: a replay "
                    f"reads input {i} as copied before fn writes input {j}, eager reads it after. "
                    f"Pass input {i} as a separate tensor, or mark it mutated too"
                )
        taken = set(mutated) | {storage_ptr(args[i]) for i in self._static}  # type: ignore[arg-type]
        cap_args = list(args)
        for i in self._mutated:
            # an alias (same storage, sizes, strides; not a view, which would keep its base
            # object alive): the capture never keeps the caller's tensor object alive, so a
            # dropped one is seen (see _Capture.dropped)
            cap_args[i] = args[i].detach()  # type: ignore[attr-defined]
        buffers: list[torch.Tensor] = []
        for i in self._user:
            x: torch.Tensor = args[i]  # type: ignore[assignment]
            ptr = storage_ptr(x)
            if i in mirrored:
                x = mirror(x)
                cap_args[i] = x
            elif self._policy.clone_input or (ptr and ptr in taken) or not non_overlapping(x):
                # the graph may depend on the input's layout (a traced view): keep its strides
                # when dense, else dense strides in the same dim order
                x = torch.empty_like(x, memory_format=torch.preserve_format).copy_(x)
                cap_args[i] = x
            taken.add(ptr)
            buffers.append(x)
        return cap_args, buffers

    def _output_plan(self, cap: _Capture) -> OutputPlan:
        in_place = {i for i in self._static + self._mutated}
        if not self._policy.clone_input:
            in_place.update(i for i in self._user if i not in cap.mirrored)
        declared = self._output_spec.aliases_input if self._output_spec is not None else ()
        return output_plan(cap.outputs, self.name, cap.args, self._user, cap.buffers, in_place,
                           declared, self._policy.clone_output)

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
        self._captures.clear()
        self._total = 0
        for cap in captures:
            cap.graph.reset()

    def reset(self) -> None:
        """Release every graph; the next call of each key captures again."""
        with self._lock:
            self._release()
            self._pool = None
            self.fell_back = False
            self.fallback_reason = None
            _compat.npugraph_ex_counters()[self._counters.captured] = 0

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


def _equal(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Constant inputs equal (identical, or ``==`` where that answers a plain bool)."""
    try:
        return bool(a == b)
    except Exception:  # an object whose == is elementwise or refuses (numpy arrays)
        return all(x is y for x, y in zip(a, b, strict=True))


@functools.cache
def _checked_ptrs_equal() -> Callable[[list[object], list[int | None], list[int]], bool] | None:
    """torch's C++ address check where it exists and answers as we read it; None otherwise."""
    equal = _compat.data_ptrs_at_indices_equal()
    if equal is None:
        return None
    a, b = torch.zeros(1), torch.zeros(1)
    try:
        right = equal([a, 0, b], [a.data_ptr(), None, b.data_ptr()], [0, 2]) and not equal(
            [a, 0, a], [a.data_ptr(), None, b.data_ptr()], [0, 2]
        )
    except (TypeError, RuntimeError):
        return None
    return equal if right else None


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
