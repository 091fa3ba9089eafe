"""The capture manager: GraphedCallable and make_graphed_callable.

A GraphedCallable owns every capture of one callable. The first call for a graph key warms up
and captures; every later call runs one precomputed closure for its key: check the addresses the
capture depends on, copy the user inputs into the capture's buffers, replay, return the outputs.
Everything else is decided at capture time."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from npugraph_runtime import _compat
from npugraph_runtime.core_limit import current_core_limit
from npugraph_runtime.counters import (
    CAPTURE_LIMIT,
    CORE_LIMIT_CHANGE,
    FORCE_EAGER,
    FORCE_RECAPTURE,
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
from npugraph_runtime.inputs import WriteWatch, non_overlapping, refiller, storage_ptr
from npugraph_runtime.keys import Args, Key, key_function, picker
from npugraph_runtime.spec import CapturePolicy, InputSpec, OutputSpec, SlotKind

__all__ = ["CaptureEvent", "GraphedCallable", "make_graphed_callable"]

_data_ptr = torch.Tensor.data_ptr
_NO_RESULT: Any = object()
_TENSOR_KINDS = (SlotKind.STATIC, SlotKind.MUTATED, SlotKind.USER)


# Profiler range names (what a trace shows); the backend's compile phases use the same prefix.
REPLAY_RANGE = "npugraph_ex::replay"
CAPTURE_RANGE = "npugraph_ex::capture"


class _Capture:
    """One captured graph and what its replay closure needs kept alive."""

    __slots__ = ("addresses", "args", "buffers", "core_limit", "graph", "key", "outputs", "replay")

    def __init__(
        self, key: Key, graph: DeviceGraph, args: list[object], buffers: list[torch.Tensor]
    ) -> None:
        self.key = key
        self.graph = graph
        self.args = args  # what the graph saw: static/mutated inputs in place, user buffers
        self.buffers = buffers
        # input index -> data_ptr at capture, for the inputs the graph uses in place
        self.addresses = {
            i: a.data_ptr() for i, a in enumerate(args) if isinstance(a, torch.Tensor)
        }
        self.core_limit = current_core_limit()
        self.outputs: object = None
        self.replay: Callable[[Args], object] = _unset


def _unset(args: Args) -> object:
    raise CaptureError("internal: a capture's replay closure was used before it was built")


class GraphedCallable:
    """Captures ``fn`` into device graphs, one per graph key, and replays them.

    ``fn`` is called positionally with the same arguments as this object. The caller
    guarantees what the spec says: static inputs keep their contents between calls (their
    addresses are checked when ``policy.check_static_addresses``), mutated inputs are the only
    tensors ``fn`` updates in place, every tensor keeps its dtype and device, the dims of a
    tensor that are not keyed keep their sizes, a static or mutated tensor at its captured
    address keeps its strides (only the address is checked), user inputs share no memory with
    mutated inputs on later calls either (checked at capture only), and constant inputs do not
    change (checked every call).
    With ``clone_output=False`` the returned tensors are the graph's static outputs: the next
    call overwrites them. With ``clone_input=False`` the first call's user tensors become the
    capture's buffers and a later call at another address overwrites them (a call whose inputs
    overlap them raises PolicyError instead); a user tensor that shares memory with another
    input, or overlaps itself, gets an owned buffer. Outputs that view a user input are views of
    the caller's tensor, as in eager.
    Refused at capture (PolicyError): fn writing a user or static input in place (declare it
    mutated), and a user input sharing memory with a mutated input."""

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
        self._pool: PoolHandle | None = None
        self._n = len(spec.kinds)
        kinds = spec.kinds
        self._user = [i for i, k in enumerate(kinds) if k is SlotKind.USER]
        self._mutated = [i for i, k in enumerate(kinds) if k is SlotKind.MUTATED]
        self._static = [i for i, k in enumerate(kinds) if k is SlotKind.STATIC]
        self._constant = [i for i, k in enumerate(kinds) if k is SlotKind.CONSTANT]
        self._key = key_function(spec)
        self._copy = _compat.foreach_copy()
        self._ptrs_equal = _checked_ptrs_equal()
        self._captures: dict[Key, _Capture] = {}
        # key -> replay closure: the only thing the hot path looks up.
        self._runs: dict[Key, Callable[[Args], object]] = {}

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
        run = self._runs.get(key)
        if run is None:
            return self._miss(key, args)
        return run(args)

    def _replay_closure(self, cap: _Capture) -> Callable[[Args], object]:
        key = cap.key
        recapture = self._recapture_changed
        replay = cap.graph.replay
        core_limit, captured_limit = current_core_limit, cap.core_limit
        # Inputs the graph uses in place: their addresses at capture, checked in one C++ call
        # where torch has one, else in one pass of data_ptr (~55 ns a tensor).
        watched = self._watched()
        watched_ptrs = [cap.addresses[i] for i in watched]
        pick_watched = picker(watched)
        all_equal = self._ptrs_equal if watched else None
        by_slot: list[int | None] = [cap.addresses.get(i) if i in watched else None
                                     for i in range(self._n)]
        pick_user = picker(self._user)
        buffers = cap.buffers
        copy = self._copy
        always_copy = self._policy.clone_input  # owned buffers never equal a caller's tensor
        unchanged, refill = refiller(buffers, copy, self._user)
        result, build = self._output_plan(cap)
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
                return recapture(key, args)
            if all_equal is not None:
                if not all_equal(list(args), by_slot, watched):
                    return recapture(key, args)
            elif pick_watched is not None and list(map(data_ptr, pick_watched(args))) != watched_ptrs:  # type: ignore[arg-type]
                return recapture(key, args)
            if pick_user is not None:
                sources = pick_user(args)
                if always_copy:
                    copy(buffers, sources)  # type: ignore[arg-type]
                elif not unchanged(sources):  # type: ignore[arg-type]
                    refill(sources)  # type: ignore[arg-type]
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

    def _watched(self) -> list[int]:
        """Inputs the graph uses in place whose address the hot path checks."""
        if self._policy.check_static_addresses:
            return sorted(self._mutated + self._static)
        return list(self._mutated)

    def _recapture_changed(self, key: Key, args: Args) -> object:
        cap = self._captures[key]
        if current_core_limit() != cap.core_limit:
            return self._capture(key, args, CORE_LIMIT_CHANGE)
        mutated = any(_data_ptr(args[i]) != cap.addresses[i] for i in self._mutated)  # type: ignore[arg-type]
        return self._capture(key, args, MUTATED_INPUT_CHANGE if mutated else STATIC_INPUT_CHANGE)

    # ---- capture ------------------------------------------------------------------------
    def _miss(self, key: Key, args: Args) -> object:
        if self.fell_back:
            return self._fn(*args)
        if self._policy.force_eager:
            self._fall_back(FORCE_EAGER)
            return self._fn(*args)
        if len(self._captures) >= self._policy.capture_limit:
            self._fall_back(CAPTURE_LIMIT)
            return self._fn(*args)
        return self._capture(key, args, NEW_KEY)

    def _capture(self, key: Key, args: Args, reason: str) -> object:
        """Capture ``key`` (replacing an older capture of it) and return the call's result.

        A new key is warmed up first and the call returns the last warmup run's result. A
        recapture is not warmed up again: it replays the fresh capture and returns that, so
        force_recapture shows what a fresh capture computes (the triage recipe relies on it)."""
        self._check_kinds(args)
        result = self._warm_up(args) if reason == NEW_KEY else _NO_RESULT
        cap = self._record(key, args)
        old = self._captures.pop(key, None)
        self._captures[key] = cap
        if self._policy.force_recapture:
            self._runs[key] = lambda a: self._capture(key, a, FORCE_RECAPTURE)
        else:
            self._runs[key] = cap.replay
        if old is not None:
            old.graph.reset()
        self.events.append(CaptureEvent(key, reason))
        self._counters.count_capture(reason, len(self._captures))
        logger.info("%s: captured graph key %s (%s)", self.name, key, reason)
        return cap.replay(args) if result is _NO_RESULT else result

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
        device = self._device_for(args)
        cap_args, buffers = self._buffers(args)
        # statics and user buffers must not be written: replays would not write the caller's
        # tensor (user) or would repeat the write warmups already made (static)
        mutated = {storage_ptr(args[i]) for i in self._mutated}  # type: ignore[arg-type]
        watched = {storage_ptr(b): i for i, b in zip(self._user, buffers, strict=True)}
        for i in self._static:
            watched.setdefault(storage_ptr(args[i]), i)  # type: ignore[arg-type]
        watch = WriteWatch({p: i for p, i in watched.items() if p and p not in mutated})
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
        cap = _Capture(key, g, cap_args, buffers)
        cap.outputs = out
        try:
            cap.replay = self._replay_closure(cap)
        except BaseException:
            g.reset()
            raise
        return cap

    def _buffers(self, args: Args) -> tuple[list[object], list[torch.Tensor]]:
        """The arguments a capture runs on and its user-input buffers. A buffer is the caller's
        own tensor only under clone_input=False, and only when no other input shares its memory
        and no two of its elements overlap; otherwise it is an owned copy with the caller's
        layout (made dense), so that refilling it never writes memory another input (or another
        element) is read from."""
        mutated = {storage_ptr(args[i]): i for i in self._mutated}  # type: ignore[arg-type]
        for i in self._user:
            j = mutated.get(storage_ptr(args[i]))  # type: ignore[arg-type]
            if j is not None and args[i].numel():  # type: ignore[attr-defined]
                raise PolicyError(
                    f"{self.name}: user input {i} shares memory with mutated input {j}: a replay "
                    f"reads input {i} as copied before fn writes input {j}, eager reads it after. "
                    f"Pass input {i} as a separate tensor, or mark it mutated too"
                )
        taken = set(mutated) | {storage_ptr(args[i]) for i in self._static}  # type: ignore[arg-type]
        cap_args = list(args)
        buffers: list[torch.Tensor] = []
        for i in self._user:
            x: torch.Tensor = args[i]  # type: ignore[assignment]
            ptr = storage_ptr(x)
            if self._policy.clone_input or (ptr and ptr in taken) or not non_overlapping(x):
                # the graph may depend on the input's layout (a traced view, as_strided): keep
                # its strides when dense, else dense strides in the same dim order
                x = torch.empty_like(x, memory_format=torch.preserve_format).copy_(x)
                cap_args[i] = x
            taken.add(ptr)
            buffers.append(x)
        return cap_args, buffers

    def _output_plan(self, cap: _Capture) -> tuple[object, Callable[[Args], object] | None]:
        """What a replay returns: a fixed object, or a builder when outputs alias inputs or are
        cloned. An output that is exactly an input (per OutputSpec, or found at capture) is
        returned as the caller's input; a view of an input the graph uses in place is never
        cloned; every other tensor is cloned when ``clone_output``."""
        out = cap.outputs
        if not isinstance(out, torch.Tensor) and type(out) not in (tuple, list):
            raise CaptureError(
                f"{self.name}: fn returned a {type(out).__name__}; a GraphedCallable needs fn to "
                "return a tensor, or a tuple or list of tensors"
            )
        outs, structure = _flatten(out, self.name)
        declared = self._output_spec.aliases_input if self._output_spec is not None else ()
        in_place = {i for i in self._static + self._mutated}
        if not self._policy.clone_input:
            in_place.update(self._user)
        user_buffers = {storage_ptr(b): (i, b) for i, b in zip(self._user, cap.buffers, strict=True)}
        user_buffers.pop(0, None)
        alias: list[tuple[int, int]] = []
        clone: list[int] = []
        views: list[_BufferView] = []
        for pos, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                continue
            j = declared[pos] if pos < len(declared) else None
            if j is None:
                j = next((i for i, a in enumerate(cap.args) if _same_view(o, a)), None)
            hit = user_buffers.get(storage_ptr(o))
            if j is not None and _same_view(o, cap.args[j]):
                alias.append((pos, j))
            elif hit is not None:
                # a view of a user input's buffer: eager returns that view of the caller's
                # tensor, and a buffer view must never reach the caller (fed back as an input,
                # it would change while the buffers are refilled)
                i, b = hit
                views.append(_BufferView(pos, i, tuple(o.shape), o.stride(),
                                         int(o.storage_offset() - b.storage_offset()), o.dtype,
                                         b.stride()))
            elif j is not None and j in in_place and _same_storage(o, cap.args[j]):  # type: ignore[arg-type]
                continue  # a view of the caller's own tensor, as in eager
            elif self._policy.clone_output:
                clone.append(pos)
        singles, groups = _clone_groups(outs, clone)

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

        if isinstance(out, torch.Tensor) or structure is None:
            # a tensor, or a flat tuple: immutable, so the same object can be returned every call
            if not alias and not clone and not views:
                return out, None
            single = isinstance(out, torch.Tensor)

            def build_flat(args: Args) -> object:
                res = fresh(args)
                return res[0] if single else tuple(res)

            return None, build_flat

        def build(args: Args) -> object:
            # lists are rebuilt every call: a caller appending to one never changes the next result
            return _unflatten(structure, iter(fresh(args)))

        return None, build

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
            "distinct graph key); all its graphs are released and it runs eagerly from now on. "
            "Raise capture_limit, or make fewer inputs dynamic"
        )
        logger.warning("%s", message)
        if not self._warned:
            self._warned = True
            warnings.warn(message, stacklevel=4)

    def _release(self) -> None:
        captures = list(self._captures.values())
        self._runs.clear()
        self._captures.clear()
        for cap in captures:
            cap.graph.reset()

    def reset(self) -> None:
        """Release every graph; the next call of each key captures again."""
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
        return len(self._captures)

    @property
    def graphs(self) -> dict[Key, DeviceGraph]:
        return {k: c.graph for k, c in self._captures.items()}

    @property
    def policy(self) -> CapturePolicy:
        return self._policy

    @property
    def spec(self) -> InputSpec:
        return self._spec

    def __repr__(self) -> str:
        return (
            f"GraphedCallable({self.name!r}, captures={len(self._captures)}, "
            f"fell_back={self.fell_back})"
        )


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


# The nesting of fn's result: None for a leaf, else (is_list, children). A flat tuple's
# structure is None too (see _flatten).
Structure = tuple[bool, list[Any]] | None


def _flatten(out: object, name: str) -> tuple[list[object], Structure]:
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


def _unflatten(structure: Structure, leaves: Iterator[object]) -> object:
    if structure is None:
        return next(leaves)
    is_list, children = structure
    items = [_unflatten(child, leaves) for child in children]
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


def _equal(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Constant inputs equal (identical, or ``==`` where that answers a plain bool)."""
    try:
        return bool(a == b)
    except Exception:  # an object whose == is elementwise or refuses (numpy arrays)
        return all(x is y for x, y in zip(a, b, strict=True))


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _same_view(a: torch.Tensor, b: object) -> bool:
    if a is b:
        return True
    return (
        isinstance(b, torch.Tensor)
        and _same_storage(a, b)
        and a.storage_offset() == b.storage_offset()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


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
