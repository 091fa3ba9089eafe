"""Recording a CPU capture: a dispatch mode that runs every ATen op once, decides how it will be
re-issued at replay, and keeps every tensor it sees alive until the capture ends.

Dispatch modes are thread-local in torch: ops that other threads run during a capture are neither
recorded nor refused (a CUDA capture in "global" mode would refuse some of them)."""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from npugraph_runtime import _compat
from npugraph_runtime._compat import TorchDispatchMode
from npugraph_runtime.devices.cpu_collectives import InFlight, is_collective, is_wait
from npugraph_runtime.devices.cpu_kernels import (
    Candidate,
    Kind,
    inplace_method_name,
    is_allocation,
    out_candidates,
    overload_name,
    same_result,
    verify_inplace_method,
    write_positions,
)
from npugraph_runtime.devices.cpu_streams import (
    CpuEvent,
    CpuStream,
    HazardTracker,
    current_cpu_stream,
    is_event_marker,
    replays_marker,
)
from npugraph_runtime.devices.no_launch import Launched, launched, launches, relaunched, stand_in
from npugraph_runtime.errors import CaptureError, CrossStreamWarning, DeviceError, NpugraphError

_CPU = torch.device("cpu")

_UNSAFE_TAGS: tuple[tuple[str, str], ...] = (
    ("data_dependent_output", "reads a tensor's value on the host (a host synchronisation)"),
    ("dynamic_output_shape", "has an output shape that depends on the data"),
    ("nondeterministic_seeded", "draws random numbers, which a replay would not redraw"),
    ("cudagraph_unsafe", "is marked unsafe for device-graph capture"),
)
_UNSAFE_NAMES = {
    "aten::is_nonzero": "reads a tensor's value on the host (a host synchronisation)",
    "aten::set_.source_Storage": "swaps a tensor's storage",
    "aten::set_.source_Storage_storage_offset": "swaps a tensor's storage",
    "aten::set_.source_Tensor": "swaps a tensor's storage",
    "aten::set_": "swaps a tensor's storage",
}
_TRUSTED_SCHEMAS = frozenset({"aten", "prims", "_c10d_functional", "npugraph_ex"})
_SDPA_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"
_COPY_OPS = frozenset({"aten::_to_copy", "aten::copy_", "aten::to.device", "aten::_copy_from"})


class TRef:
    """A recorded tensor, by its index in ``Recorder.tensors``."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


@dataclass(slots=True, eq=False)
class TensorEntry:
    obj: torch.Tensor | None
    storage: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(slots=True, eq=False)
class StorageEntry:
    obj: torch.UntypedStorage | None
    produced: bool  # first seen as the output of a recorded op
    first: int
    last: int
    nbytes: int
    pinned: bool = False  # never pooled, never dropped (frozen results, unusual layouts)


@dataclass(slots=True, eq=False)
class Step:
    func: Any
    kind: Kind
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    outs: tuple[tuple[tuple[int, ...], TRef], ...] = ()  # (path into the result, tensor)
    call: Any = None
    out_names: tuple[str, ...] = ()
    method: str = ""
    saved: tuple[tuple[TRef, torch.Tensor], ...] = ()  # FROZEN: values to copy back
    candidates: list[Candidate] = field(default_factory=list)  # verified ways to re-issue it
    stream: CpuStream | None = None  # the logical stream the op was issued on


def _leaves(value: Any, path: tuple[int, ...] = ()) -> Iterator[tuple[tuple[int, ...], Any]]:
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i))
    else:
        yield path, value


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _tensor_list(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among an op's arguments, nested lists included, in order."""
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += _tensors(value)
    return found


@dataclass(frozen=True, slots=True)
class _OpInfo:
    """What the recorder asks of an op on every call that its schema and tags alone decide."""

    name: str  # overload_name
    unsafe_tags: tuple[tuple[str, str], ...]  # its tags of _UNSAFE_TAGS, in that order
    named_reason: str | None  # _UNSAFE_NAMES
    copies: bool  # one of _COPY_OPS: unsafe when it copies between devices
    writes: tuple[tuple[int, ...], tuple[str, ...]]  # write_positions
    trusted_schema: bool  # its namespace declares what it writes
    metadata_only: bool  # an in-place view op
    wait: bool  # a collective's wait
    functional_collective: bool  # a _c10d_functional op
    event_marker: bool  # a graph-event op: program order orders a replay, so it is left out
    marker: bool  # a scope op a replay runs again
    allocation: bool


@cache
def _op_info(func: Any) -> _OpInfo:
    name = overload_name(func)
    tags = func.tags
    unsafe_tags = tuple(
        (tag_name, why) for tag_name, why in _UNSAFE_TAGS
        if (tag := getattr(torch.Tag, tag_name, None)) is not None and tag in tags
    )
    return _OpInfo(
        name,
        unsafe_tags,
        _UNSAFE_NAMES.get(name),
        str(_compat.op_schema(func).name) in _COPY_OPS or name in _COPY_OPS,
        write_positions(func),
        func.namespace in _TRUSTED_SCHEMAS,
        torch.Tag.inplace_view in tags,
        is_wait(func),
        func.namespace == "_c10d_functional",
        is_event_marker(func),
        replays_marker(func),
        is_allocation(func),
    )


def _argument(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    for i, arg in enumerate(_compat.op_schema(func).arguments):
        if arg.name == name:
            if i < len(args) and not arg.kwarg_only:
                return args[i]
            return kwargs.get(name, arg.default_value if arg.has_default_value() else None)
    return None


def _draws_nothing(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Ops tagged as seeded that draw no random number with these arguments: attention and
    dropout with probability 0 (SDPA kernels carry the tag for their dropout) or not training."""
    names = {a.name for a in _compat.op_schema(func).arguments}
    for p_name in ("dropout_p", "p"):
        if p_name in names and _argument(func, args, kwargs, p_name) == 0:
            return True
    return "train" in names and _argument(func, args, kwargs, "train") is False


def _shape_fixed_here(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Ops tagged as having a data-dependent output shape whose shape is fixed by these
    arguments: indexing with integer index tensors (only boolean masks make it data-dependent)."""
    if overload_name(func) != "aten::index.Tensor":
        return False
    indices = _argument(func, args, kwargs, "indices") or ()
    return all(
        i is None or (isinstance(i, torch.Tensor) and i.dtype not in (torch.bool, torch.uint8))
        for i in indices
    )


def _plain(t: torch.Tensor) -> bool:
    return (
        t.layout == torch.strided
        and not t.is_conj()
        and not t.is_neg()
        and not t.is_quantized
        and t.device == _CPU
    )


def _exact_copy(t: torch.Tensor) -> torch.Tensor:
    c = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
    c.copy_(t)
    return c


# Tensor methods that read values on the host without dispatching an ATen op (so the dispatch
# mode never sees them): a replay would repeat what they read at capture.
_HOST_READ_METHODS = {
    torch.Tensor.tolist: "Tensor.tolist()",
    torch.Tensor.numpy: "Tensor.numpy()",
    torch.Tensor.__array__: "Tensor.__array__() (numpy conversion)",
    torch.Tensor.__repr__: "Tensor.__repr__() (printing a tensor)",
    torch.Tensor.__format__: "Tensor.__format__() (formatting a tensor)",
}
# Constructors that read the values of tensors nested in their data argument on the host.
_CONSTRUCTORS = {torch.tensor: "torch.tensor", torch.as_tensor: "torch.as_tensor",
                 torch.asarray: "torch.asarray"}


def _nests_tensor(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and any(
        isinstance(v, torch.Tensor) or _nests_tensor(v) for v in value
    )


class HostReads(TorchFunctionMode):
    """Refuses, during a capture, the host reads of tensor values that bypass ATen dispatch:
    on the CPU they succeed silently and every replay would repeat the values they read."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        recorder = self.recorder
        if recorder.error is None:
            what = _HOST_READ_METHODS.get(func)
            if what is None and func in _CONSTRUCTORS:
                data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
                if _nests_tensor(data):
                    what = f"{_CONSTRUCTORS[func]}() of a list holding tensors"
            if what is not None:
                if recorder.mode == "relaxed":
                    if recorder.local and recorder.reads_local(_tensor_list(args, kwargs)):
                        error = recorder.local_read(what)
                        recorder.fail(error)
                        raise error
                    recorder.frozen.append(what)
                else:
                    error = CaptureError(
                        f"{what} cannot be captured: it reads tensor values on the host, and "
                        "every replay would repeat the values it read during capture. Move it out "
                        "of the captured region, or capture with capture_error_mode='relaxed' to "
                        f"accept that (mode is {recorder.mode!r})"
                    )
                    recorder.fail(error)
                    raise error
        return func(*args, **kwargs)


class Recorder(TorchDispatchMode):  # type: ignore[misc]
    """Records the ops of one capture. Created by ``CpuGraph.capture_begin``."""

    # higher-order operators (invoke_subgraph, flex_attention, scan, ...) are recorded as the ATen
    # ops their eager implementation runs (see __torch_dispatch__)
    supports_higher_order_operators = True

    def __init__(self, mode: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.mode = mode
        self.steps: list[Step] = []
        self.tensors: list[TensorEntry] = []
        self.storages: list[StorageEntry] = []
        self.error: NpugraphError | None = None
        self.frozen: list[str] = []
        self.hazards = HazardTracker()
        self.hazard_reported = False
        self._tensor_ix: dict[int, int] = {}
        self._storage_ix: dict[int, int] = {}
        self._snapshots: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self.host_reads = HostReads(self)
        # kernel choice across ops: the step that produced each storage, and the last step that
        # wrote each storage (a pre-existing one in place, a produced one by its producer)
        self._producer: dict[int, int] = {}
        self._last_write: dict[int, int] = {}
        self.in_flight = InFlight()
        # launch collectives while recording (the run is the caller's call), or only record them
        self.launch = True
        # what each collective launched left, kept when the run may be made again (None: not
        # kept), and what an earlier run's launches left, handed out in order instead of launching
        self.launched: list[Launched] | None = None
        self.relaunch: deque[Launched] = deque()
        # storages holding values made from a collective that stood in for itself: this rank's
        # own, not the collective's, so relaxed mode must not freeze a host read of them
        self.local: set[int] = set()

    # --- bookkeeping ---------------------------------------------------------------------------
    def _ref(self, t: torch.Tensor, index: int, produced: bool = False) -> int:
        i = self._tensor_ix.get(id(t))
        if i is not None:
            self.storages[self.tensors[i].storage].last = index
            return i
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            raise CaptureError(
                f"a {type(t).__name__} with layout {t.layout} cannot be captured by the cpu "
                "graph: it records plain dense (strided) tensors only; convert it (.to_dense(), "
                ".full_tensor()) outside the captured region"
            ) from None
        si = self._storage_ix.get(id(st))
        if si is None:
            si = len(self.storages)
            self._storage_ix[id(st)] = si
            self.storages.append(StorageEntry(st, produced, index, index, st.nbytes()))
        entry = self.storages[si]
        entry.last = index
        if not _plain(t):
            entry.pinned = True
        i = len(self.tensors)
        self._tensor_ix[id(t)] = i
        self.tensors.append(
            TensorEntry(t, si, t.dtype, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))
        )
        return i

    def _conv(self, value: Any, index: int) -> Any:
        if isinstance(value, torch.Tensor):
            return TRef(self._ref(value, index))
        if isinstance(value, list):
            return [self._conv(v, index) for v in value]
        if isinstance(value, tuple):
            return tuple(self._conv(v, index) for v in value)
        return value

    def _storage_of(self, t: torch.Tensor) -> int | None:
        return self._storage_ix.get(id(t.untyped_storage()))

    def _snapshot(self, t: torch.Tensor) -> None:
        """Keep a copy of a pre-existing storage before the capture first writes it."""
        si = self._storage_of(t)
        if si is not None and self.storages[si].produced:
            return
        st = t.untyped_storage()
        if id(st) not in self._snapshots:
            self._snapshots[id(st)] = (st, st.clone())  # type: ignore[no-untyped-call]

    def reads_local(self, tensors: list[torch.Tensor]) -> bool:
        """Some of ``tensors`` hold values made from a collective that stood in for itself."""
        return any(self._storage_of(t) in self.local for t in tensors)

    def local_read(self, what: str) -> CaptureError:
        return CaptureError(
            f"{what} reads on the host a value made from a collective that this capture records "
            "without launching it (the capture's run is not the call's: warmup=0, "
            "force_recapture, or a hand-written fn's capture after its warm-up), so the value "
            "is this rank's own, not the collective's result, and capture_error_mode='relaxed' "
            "would make every replay repeat it. Move the host read out of the captured region "
            "(pass the value in as an argument), or compute with the tensor instead of reading it"
        )

    def clear_index(self) -> None:
        """Forget the id-based lookups (they keep no tensor alive, but ids are reused later)."""
        self._tensor_ix.clear()
        self._storage_ix.clear()

    def restore(self) -> None:
        """Undo every write the capture made to storages that existed before it."""
        for st, saved in self.take_snapshots():
            st.copy_(saved)

    def take_snapshots(self) -> list[tuple[torch.UntypedStorage, torch.UntypedStorage]]:
        """Each storage that existed before the capture and was written during it, with its
        contents before; the recorder forgets them (they are the caller's to restore or drop)."""
        taken = list(self._snapshots.values())
        self._snapshots.clear()
        return taken

    def fail(self, error: NpugraphError) -> None:
        if self.error is None:
            self.error = error
            self.restore()

    # --- kernel choice across ops ------------------------------------------------------------
    def _expanded_source(self, t: torch.Tensor, before: int) -> torch.Tensor | None:
        """For ``t``, the whole result of a ``clone`` of ``x[:, :, None].expand(..)`` (transformers'
        repeat_kv), the un-repeated ``x``, when nothing wrote ``x`` or the copy between that clone
        and step ``before``; else None. Checked on the recording, not on data: a capture on a
        zero KV cache cannot tell a scaled copy from the cache."""
        si = self._storage_of(t)
        at = self._producer.get(si) if si is not None else None
        if at is None or t.storage_offset() != 0 or not t.is_contiguous():
            return None
        if self._last_write.get(si) != at:  # type: ignore[arg-type]
            return None  # the repeated copy was written after the clone (e.g. scaled in place)
        clone = self.steps[at]
        if overload_name(clone.func) != "aten::clone" or not clone.args:
            return None
        src_ref = clone.args[0]
        if not isinstance(src_ref, TRef):
            return None
        src = self.tensors[src_ref.i].obj
        if src is None or src.dim() != 5 or src.stride(2) != 0 or src.numel() != t.numel():
            return None
        b, heads, rep, seq, dim = src.shape
        if tuple(t.shape) != (b, heads * rep, seq, dim):
            return None
        base = src.select(2, 0)
        base_si = self._storage_of(base)
        if base_si is None or self._last_write.get(base_si, -1) >= at:
            return None  # the source was written after the clone read it
        return base

    def _read_grouped_kv(
        self, step: Step, args: tuple[Any, ...], kwargs: dict[str, Any],
        leaves: list[tuple[tuple[int, ...], torch.Tensor]], index: int,
    ) -> None:
        """CPU attention with grouped KV heads: the kernel reads ``key``/``value`` with fewer
        heads than ``query`` itself, so the replay passes the un-repeated KV and skips the
        repeat_kv copies (they are dropped when nothing else reads them). Kept only when it
        gives the recorded results bitwise, here on the capture's data."""
        if len(args) < 3 or not all(isinstance(a, torch.Tensor) for a in args[:3]):
            return
        key = self._expanded_source(args[1], index)
        value = self._expanded_source(args[2], index)
        if key is None or value is None:
            return
        fewer = (args[0], key, value, *args[3:])
        got: list[Any] = []
        try:
            got.append(step.func(*fewer, **kwargs))
        except Exception:  # a kernel that does not take grouped heads: keep the copies
            return
        fresh = [g for _, g in _leaves(got[0]) if isinstance(g, torch.Tensor)]
        if len(fresh) != len(leaves) or not all(
            same_result(g, t) for (_, t), g in zip(leaves, fresh, strict=True)
        ):
            return
        step.args = (step.args[0], TRef(self._ref(key, index)), TRef(self._ref(value, index)),
                     *step.args[3:])
        # the other candidates were verified on the repeated KV: re-issue the op itself
        step.candidates = [Candidate(Kind.COPY, _compat.op_entry(step.func), label="op")]

    # --- events (called through cpu_streams hooks) --------------------------------------------
    def event_record(self, event: CpuEvent, stream: CpuStream) -> None:
        if self.error is None:
            self.hazards.record(event, stream)

    def event_wait(self, event: CpuEvent, stream: CpuStream) -> None:
        if self.error is None:
            self.hazards.wait(event, stream)

    # --- the dispatch hook ---------------------------------------------------------------------
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.error is not None:
            if not self.launch and launches(func):
                return stand_in(func, args, kwargs)
            return func(*args, **kwargs)
        if _compat.is_higher_order(func):
            return self._inline(func, args, kwargs)
        # the recorder's own tensor work (checks, copies, timing candidates) is not the user's:
        # keep it out of the host-read guard
        with _compat.no_torch_function():
            try:
                # a functional collective's lazy result waits in its own dispatch, unseen: the
                # wait is recorded here, before the op that uses it, or a replay would read the
                # result before it is there
                resolved = _compat.resolve_async_collectives(args, kwargs, self._wait_async)
                if resolved is not None:
                    args, kwargs = resolved
                return self._record(func, args, kwargs)
            except NpugraphError as e:
                self.fail(e)
                raise

    def _wait_async(self, t: Any) -> torch.Tensor:
        elem: torch.Tensor = t.elem
        if not t.completed:
            self._record(_compat.wait_tensor_overload(), (elem,), {})
            t.completed = True
        return elem

    def _inline(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A higher-order operator: its eager implementation runs with the recorder active again,
        so each ATen op of its body is recorded and replayed like any other (a branch or a loop
        decided by a tensor's value reads it back, which the recorder refuses as a host sync)."""
        body = _compat.higher_order_body(func, args, kwargs)
        if body is None:
            error = CaptureError(
                f"{func!r} cannot be captured by the cpu graph: it has no eager implementation to "
                "record; run it outside the captured region")
            self.fail(error)
            raise error
        with self:
            return body()

    def _track_collective(
        self,
        func: Any,
        args: tuple[Any, ...],
        index: int,
        fresh: tuple[tuple[tuple[int, ...], TRef], ...],
        written: list[torch.Tensor],
        in_storages: set[int | None],
    ) -> None:
        """A collective's inputs live in the pool plan until its wait (see cpu_collectives)."""
        if is_collective(func):
            writes = {self.tensors[r.i].storage for _, r in fresh}
            writes |= {s for s in map(self._storage_of, written) if s is not None}
            self.in_flight.issued(writes, {s for s in in_storages if s is not None})
        elif is_wait(func) and args and isinstance(args[0], torch.Tensor):
            for s in self.in_flight.waited(self._storage_of(args[0])):
                self.storages[s].last = max(self.storages[s].last, index)

    def _unsafe_reason(
        self, info: _OpInfo, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> str | None:
        for tag_name, why in info.unsafe_tags:
            if tag_name == "nondeterministic_seeded" and _draws_nothing(func, args, kwargs):
                continue
            if tag_name == "dynamic_output_shape" and _shape_fixed_here(func, args, kwargs):
                continue
            return why
        if info.named_reason is not None:
            return info.named_reason
        if info.copies:
            devices = {t.device for t in _tensors((args, tuple(kwargs.values())))}
            target = kwargs.get("device")
            if target is not None:
                devices.add(torch.device(target))
            if len(devices) > 1:
                return "copies between devices (" + ", ".join(sorted(map(str, devices))) + ")"
        return None

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        index = len(self.steps)
        name = str(func)
        info = _op_info(func)
        reason = self._unsafe_reason(info, func, args, kwargs)
        inputs = _tensor_list(args, kwargs)
        if reason is not None and self.mode == "relaxed" and self.local and self.reads_local(inputs):
            raise self.local_read(name)
        if reason is not None and self.mode != "relaxed":
            raise CaptureError(
                f"{name} cannot be captured: it {reason}. Move it out of the captured region, or "
                f"capture with capture_error_mode='relaxed' to let replays repeat the value it "
                f"produced during capture (mode is {self.mode!r})"
            )
        if reason is None:
            for t in inputs:
                if t.device != _CPU:
                    raise DeviceError(
                        f"{name} got a tensor on {t.device} while capturing a cpu graph: a graph "
                        f"captures one device; move every tensor the function uses to cpu"
                    )
        positions, names = info.writes
        written = [t for i in positions if i < len(args) for t in _tensors(args[i])]
        written += [t for n in names for t in _tensors(kwargs.get(n))]
        # a custom op's schema may not declare its writes: keep every pre-existing input it gets
        for t in written if info.trusted_schema else inputs:
            if t.device == _CPU:
                self._snapshot(t)
        method = None
        before = None
        if reason is None and written:
            method = inplace_method_name(func, args)
            if method is not None:
                self_storage = args[0].untyped_storage()
                if all(t.untyped_storage() is not self_storage for t in inputs[1:]):
                    before = _exact_copy(args[0])
        stood_in = False
        if not launches(func):
            result = func(*args, **kwargs)
        elif not self.launch:  # recorded, launched by the replays only (see no_launch)
            result = stand_in(func, args, kwargs)
            stood_in = True
        else:
            if self.relaunch:  # an earlier run of this call launched it already
                result = relaunched(self.relaunch.popleft(), func, args, kwargs, written)
            else:
                result = func(*args, **kwargs)
            if self.launched is not None:
                self.launched.append(launched(func, result, written))
        leaves: list[tuple[tuple[int, ...], torch.Tensor]] = (
            [((), result)] if isinstance(result, torch.Tensor)
            else [(p, v) for p, v in _leaves(result) if isinstance(v, torch.Tensor)]
        )
        if reason is None:
            for _, t in leaves:
                if t.device != _CPU:
                    raise DeviceError(
                        f"{name} produced a tensor on {t.device} while capturing a cpu graph: "
                        f"a graph captures one device"
                    )
        metadata_only = info.metadata_only
        if metadata_only:
            # the tensor's metadata changed: later ops must see the new view, earlier ones the old
            for t in written:
                self._tensor_ix.pop(id(t), None)

        args_r = self._conv(args, index)
        kwargs_r = {k: self._conv(v, index) for k, v in kwargs.items()}
        in_storages = {self._storage_of(t) for t in inputs}
        known_before = len(self.storages)
        outs = tuple((p, TRef(self._ref(t, index, produced=True))) for p, t in leaves)
        if stood_in or (self.local and not self.local.isdisjoint(in_storages)):
            self.local.update(self.tensors[r.i].storage for _, r in outs)
            self.local.update(s for s in map(self._storage_of, written) if s is not None)
        fresh = tuple(
            (p, r) for p, r in outs if self.tensors[r.i].storage >= known_before
        )
        stream = current_cpu_stream()
        step = Step(func, Kind.SKIP, args_r, kwargs_r, outs, stream=stream)

        op = _Op(func, info, args, kwargs, index, reason, written, leaves, outs, fresh,
                 metadata_only, method, before)
        next(fill for applies, fill in _KIND_RULES if applies(op))(self, op, step)
        if step.kind is Kind.COPY and info.name == _SDPA_CPU:
            self._read_grouped_kv(step, args, kwargs, leaves, index)
        for _, r in step.outs:
            self._producer.setdefault(self.tensors[r.i].storage, index)
        if step.kind is not Kind.SKIP:  # views write nothing
            for si in {self.tensors[r.i].storage for _, r in step.outs} | {
                s for s in (self._storage_of(t) for t in written) if s is not None
            }:
                self._last_write[si] = index
        self.steps.append(step)
        if reason is None:
            self._track_collective(func, args, index, fresh, written, in_storages)

        if step.kind is not Kind.SKIP and not self.hazard_reported:
            writes = {self.tensors[r.i].storage for _, r in fresh}
            writes |= {s for s in (self._storage_of(t) for t in written) if s is not None}
            reads = {s for s in in_storages if s is not None} - writes
            problem = self.hazards.access(index, name, stream, reads, writes)
            if problem is not None:
                self.hazard_reported = True
                warnings.warn(problem, CrossStreamWarning, stacklevel=2)
        return result


@dataclass(slots=True, eq=False)
class _Op:
    """One op as ``Recorder._record`` saw it run: what picks the kind of its step."""

    func: Any
    info: _OpInfo
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
    before: torch.Tensor | None  # its self argument before it ran, to verify ``method``


def _frozen(rec: Recorder, op: _Op, step: Step) -> None:
    """Replays repeat the values it produced during capture (relaxed mode)."""
    rec.frozen.append(str(op.func))
    step.kind = Kind.FROZEN
    targets = [t for _, t in op.leaves] + op.written
    step.saved = tuple(
        (TRef(rec._ref(t, op.index)), _exact_copy(t)) for t in targets if _plain(t)
    )
    for t in targets:
        si = rec._storage_of(t)
        if si is not None and rec.storages[si].produced:
            rec.storages[si].pinned = True


def _skip(rec: Recorder, op: _Op, step: Step) -> None:
    """Nothing to re-issue: views (every result aliases an input), non-tensor results,
    allocations, and in-place view ops (replays see the recorded view; re-issuing would apply
    it twice)."""
    step.kind = Kind.SKIP


def _writes(rec: Recorder, op: _Op, step: Step) -> None:
    """An op that writes its inputs: re-issued as its in-place method where that was verified
    to give the same result, else as it is."""
    if (
        op.method is not None
        and op.before is not None
        and verify_inplace_method(op.method, op.before, op.args[0], op.args, op.kwargs)
    ):
        step.kind, step.method = Kind.INPLACE_METHOD, op.method
    else:
        step.kind = Kind.AS_IS
        step.outs = op.fresh


def _collective_wait(rec: Recorder, op: _Op, step: Step) -> None:
    """Returns its argument, yet must be re-issued."""
    step.kind = Kind.COLLECTIVE_WAIT


def _collective(rec: Recorder, op: _Op, step: Step) -> None:
    step.kind, step.outs = Kind.COLLECTIVE, op.fresh


def _as_is(rec: Recorder, op: _Op, step: Step) -> None:
    """Re-issued as recorded: stream markers, and custom ops with no fresh result (their schema
    may not declare what they write, so they are not trusted to be views)."""
    step.kind = Kind.AS_IS


def _computes(rec: Recorder, op: _Op, step: Step) -> None:
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
_KIND_RULES: tuple[tuple[Callable[[_Op], bool], Callable[[Recorder, _Op, Step], None]], ...] = (
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
