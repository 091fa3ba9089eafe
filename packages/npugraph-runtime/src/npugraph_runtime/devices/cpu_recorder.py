"""Recording a CPU capture: a dispatch mode that runs every ATen op once, decides how it will be
re-issued at replay, and keeps every tensor it sees alive until the capture ends.

Dispatch modes are thread-local in torch: ops that other threads run during a capture are neither
recorded nor refused (a CUDA capture in "global" mode would refuse some of them).

What the recording holds is in cpu_record.py, what the recorder reads of an op in cpu_op_info.py,
the rules that pick each step's kind in cpu_step_kinds.py, the host-read refusal in
cpu_host_reads.py."""

from __future__ import annotations

import warnings
from collections import deque
from typing import Any

import torch

from npugraph_runtime import _compat
from npugraph_runtime._compat import TorchDispatchMode
from npugraph_runtime.devices.cpu_candidates import (
    Candidate,
    Kind,
    inplace_method_name,
    same_result,
)
from npugraph_runtime.devices.cpu_collectives import InFlight, is_collective, is_wait
from npugraph_runtime.devices.cpu_host_reads import HostReads
from npugraph_runtime.devices.cpu_op_info import op_info, unsafe_reason
from npugraph_runtime.devices.cpu_record import (
    CPU,
    Step,
    StorageEntry,
    TensorEntry,
    TRef,
    is_plain,
    leaves_of,
    tensor_list,
    tensors_of,
)
from npugraph_runtime.devices.cpu_step_kinds import KIND_RULES, RecordedOp
from npugraph_runtime.devices.cpu_streams import (
    CpuEvent,
    CpuStream,
    HazardTracker,
    current_cpu_stream,
)
from npugraph_runtime.devices.cpu_undo import UndoLog
from npugraph_runtime.devices.no_launch import Launched, launched, launches, relaunched, stand_in
from npugraph_runtime.errors import CaptureError, CrossStreamWarning, DeviceError, NpugraphError
from npugraph_runtime.schema import overload_name

_SDPA_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"


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
        self._undo = UndoLog()
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
        if not is_plain(t):
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

    def _before_write(self, t: torch.Tensor, func: Any, args: tuple[Any, ...]) -> None:
        """Keep what ``func`` is about to overwrite in a pre-existing storage (cpu_undo)."""
        si = self._storage_of(t)
        if si is not None and self.storages[si].produced:
            return
        self._undo.before_write(t, func, args)

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
        self.take_undo().undo()

    def take_undo(self) -> UndoLog:
        """What the capture overwrote in storages that existed before it; the recorder forgets
        it (it is the caller's to undo or drop)."""
        taken, self._undo = self._undo, UndoLog()
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
        fresh = [g for _, g in leaves_of(got[0]) if isinstance(g, torch.Tensor)]
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

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        index = len(self.steps)
        name = str(func)
        info = op_info(func)
        reason = unsafe_reason(info, func, args, kwargs)
        inputs = tensor_list(args, kwargs)
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
                if t.device != CPU:
                    raise DeviceError(
                        f"{name} got a tensor on {t.device} while capturing a cpu graph: a graph "
                        f"captures one device; move every tensor the function uses to cpu"
                    )
        positions, names = info.writes
        written = [t for i in positions if i < len(args) for t in tensors_of(args[i])]
        written += [t for n in names for t in tensors_of(kwargs.get(n))]
        # a custom op's schema may not declare its writes: keep every pre-existing input it gets
        for t in written if info.trusted_schema else inputs:
            if t.device == CPU:
                self._before_write(t, func, args)
        method = inplace_method_name(func, args) if reason is None and written else None
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
            else [(p, v) for p, v in leaves_of(result) if isinstance(v, torch.Tensor)]
        )
        if reason is None:
            for _, t in leaves:
                if t.device != CPU:
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

        op = RecordedOp(func, info, args, kwargs, index, reason, written, leaves, outs, fresh,
                 metadata_only, method)
        next(fill for applies, fill in KIND_RULES if applies(op))(self, op, step)
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
