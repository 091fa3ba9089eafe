"""The emulated CPU device graph.

``CpuGraph`` has the semantics of a CUDA graph on the CPU: a capture runs the function once and
records every ATen op; a replay re-issues those ops into the same storages, reading the static
inputs' current values and overwriting the captured outputs in place, with no Python per op.

What the user must guarantee (as with CUDA graphs):

* tensors used by the captured function keep their storage: write new data into the static input
  tensors (``copy_``) instead of passing new tensors; outputs are overwritten by the next replay;
* the function does not depend on tensor values read on the host (``.item()``, ``nonzero``, data
  dependent Python control flow), nor on random numbers: such ops are refused (modes "global",
  "thread_local") or frozen to their captured values (mode "relaxed");
* graphs that share a pool are never replayed concurrently, and one graph is replayed by one
  thread at a time.

Difference from CUDA: torch dispatch modes are thread-local, so only the capturing thread's ops are
recorded and checked; "global" and "thread_local" behave the same, and ops other threads run during
the capture are neither recorded nor refused. The capture applies no side effects: storages that
existed before the capture and were written during it are restored when it ends, unless
``keep_writes`` was set before it ended (then ``undo_writes()`` restores them, ``written()`` names
them)."""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from npugraph_runtime import _compat
from npugraph_runtime.devices.base import CAPTURE_ERROR_MODES, PoolHandle, check_capture_error_mode
from npugraph_runtime.devices.cpu_kernels import capture_checks_begin, capture_checks_end
from npugraph_runtime.devices.cpu_pool import (
    Block,
    CpuPool,
    Lifetime,
    cpu_pool,
    cpu_pool_bytes,
    new_cpu_pool_handle,
)
from npugraph_runtime.devices.cpu_record import TensorEntry
from npugraph_runtime.devices.cpu_recorder import Recorder
from npugraph_runtime.devices.cpu_replay import generate
from npugraph_runtime.devices.cpu_streams import (
    CpuEvent,
    CpuStream,
    current_cpu_stream,
    set_cpu_stream,
    set_event_hooks,
)
from npugraph_runtime.devices.cpu_undo import UndoLog
from npugraph_runtime.devices.no_launch import Launched
from npugraph_runtime.errors import CaptureError, DeviceError, PolicyError

_CPU = torch.device("cpu")


class _Capturing(threading.local):
    graph: CpuGraph | None = None


_CAPTURING = _Capturing()


class CpuGraph:
    """A device graph on the CPU (see the module docstring for what the user must guarantee)."""

    capture_computes = True  # the recorder runs every op it records

    def __init__(self, device: torch.device | str | None = None) -> None:
        if device is not None and torch.device(device).type != "cpu":
            raise DeviceError(f"CpuGraph got device={device!r}; it captures 'cpu' only")
        self.device = _CPU
        self._private = new_cpu_pool_handle()
        self._handle: PoolHandle = self._private
        self._recorder: Recorder | None = None
        self._pool: CpuPool | None = None
        self._claims: Callable[[], object] | None = None  # a weakref.finalize: releases once
        self._replay: Any = None
        self._issued = 0
        self._tensors: list[TensorEntry] = []
        # the capture's run computes: when set, a successful capture keeps its writes to
        # storages that existed before it (the run then is the caller's call, see capture.py)
        self.keep_writes = False
        # the capture's run launches the collectives it records; when unset they are recorded
        # only and stand in for themselves locally, as an accelerator's capture launches nothing
        self.launch_collectives = True
        # the capture may be made again in the same call: keep what its launched collectives left
        # (``launched()``), for the next capture to take instead of launching them (``relaunch``)
        self.keep_launched = False
        self.relaunch: list[Launched] = []
        self._launched: list[Launched] = []
        self._kept = UndoLog()

    # --- capture -------------------------------------------------------------------------------
    def capture_begin(self, pool: PoolHandle | None = None, capture_error_mode: str = "global") -> None:
        """Start recording the ops this thread runs. ``pool``: share memory with the other graphs
        captured into it (from ``graph_pool_handle("cpu")`` or another graph's ``pool()``); None
        is the graph's private pool. Capturing a graph that holds a capture replaces it.

        If an op is refused, CaptureError is raised from that op and later ops run eagerly,
        unrecorded; the capture must still be ended: ``capture_end()`` (raises) or
        ``abort_capture()`` (``npugraph_runtime.graph`` does that for you)."""
        check_capture_error_mode(capture_error_mode)
        if self._recorder is not None:
            raise CaptureError("capture_begin() called on a graph that is already capturing")
        active = _CAPTURING.graph
        if active is not None:
            failed = active._recorder is not None and active._recorder.error is not None
            raise CaptureError(
                "capture_begin() called while another graph is capturing in this thread: "
                "captures cannot nest; "
                + (
                    "that capture failed and was never ended: call its abort_capture()"
                    if failed
                    else "end the other capture first"
                )
            )
        if pool is not None and (not isinstance(pool, PoolHandle) or pool.device.type != "cpu"):
            raise DeviceError(
                f"pool={pool!r} is not a cpu pool: give a handle from graph_pool_handle('cpu')"
            )
        self._handle = self._private if pool is None else pool
        if self._replay is not None:
            self._release()
        self._pool = cpu_pool(self._handle)
        recorder = Recorder(capture_error_mode)
        recorder.launch = self.launch_collectives
        recorder.launched = [] if self.keep_launched else None
        recorder.relaunch.extend(self.relaunch)
        recorder.__enter__()  # type: ignore[no-untyped-call]
        recorder.host_reads.__enter__()  # type: ignore[no-untyped-call]
        capture_checks_begin()
        self._recorder = recorder
        set_event_hooks(recorder)
        _CAPTURING.graph = self

    def _stop_recording(self) -> Recorder:
        recorder = self._recorder
        if recorder is None:
            raise CaptureError("capture_end() called without capture_begin()")
        if _CAPTURING.graph is not self:
            raise CaptureError(
                "capture_end() called from another thread than the one that began the capture: "
                "dispatch modes are per thread, so end it where it began"
            )
        try:
            recorder.host_reads.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            recorder.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        finally:
            self._recorder = None
            capture_checks_end()
            set_event_hooks(None)
            _CAPTURING.graph = None
        return recorder

    def abort_capture(self) -> None:
        """End a capture without keeping it (the function raised): writes are undone and the
        graph is left uncaptured."""
        recorder = self._stop_recording()
        recorder.restore()
        self._pool = None

    def capture_end(self) -> None:
        recorder = self._stop_recording()
        self._launched = recorder.launched or []
        if self.keep_writes and recorder.error is None:
            self._kept = recorder.take_undo()
        else:
            recorder.restore()
        if recorder.error is not None:
            self._pool = None
            raise CaptureError(f"the capture was aborted: {recorder.error}") from recorder.error
        if recorder.frozen:
            names = ", ".join(dict.fromkeys(recorder.frozen))
            warnings.warn(
                f"capture_error_mode='relaxed': every replay repeats the values captured for "
                f"{names} instead of recomputing them",
                UserWarning,
                stacklevel=2,
            )
        assert self._pool is not None
        blocks, dead = _place_intermediates(recorder, self._pool)
        # a graph dropped without reset() still gives its blocks back to the pool
        self._claims = weakref.finalize(self, self._pool.release, blocks)
        self._tensors = recorder.tensors
        self._replay, self._issued = generate(recorder.steps, recorder.tensors, dead)
        # the recording's Python storage objects go now, not when the collector finds the
        # recorder: a reference to one of them is how a caller keeping only
        # ``out.untyped_storage()`` is seen (ledger.py), so none may go away later
        recorder.storages.clear()

    def stop_launching(self) -> None:
        """The capture in progress records the collectives still to come without launching them
        (its run is to be discarded and made again)."""
        if self._recorder is not None:
            self._recorder.launch = False

    def launched(self) -> list[Launched]:
        """What the last capture's launched collectives left (``keep_launched``), in their order."""
        return self._launched

    def written(self) -> list[torch.UntypedStorage]:
        """The storages that existed before the last capture and that its kept run wrote."""
        return self._kept.storages()

    def undo_writes(self) -> None:
        """Restore what the last capture's kept run wrote (``keep_writes``); once."""
        kept, self._kept = self._kept, UndoLog()
        kept.undo()

    def drop_undo(self) -> None:
        """Keep the last capture's writes for good: free the copies of what they overwrote."""
        self._kept = UndoLog()

    # --- use -----------------------------------------------------------------------------------
    def replay(self) -> None:
        fn = self._replay
        if fn is None:
            if self._recorder is not None:
                raise CaptureError("replay() called on a graph that is capturing: end the capture first")
            raise CaptureError(
                "replay() called on a graph that holds no capture: capture it first "
                "(with npugraph_runtime.graph(g): ...)"
            )
        fn()

    def reset(self) -> None:
        """Drop the capture and release the graph's claims on its pool."""
        if self._recorder is not None:
            raise CaptureError("reset() called while the graph is capturing: end the capture first")
        self._release()

    def _release(self) -> None:
        if self._claims is not None:
            self._claims()
        self._claims = None
        self._pool = None
        self._replay = None
        self._issued = 0
        self._tensors = []

    def pool(self) -> PoolHandle:
        return self._handle

    def __repr__(self) -> str:
        state = (
            "capturing"
            if self._recorder is not None
            else f"{self._issued} ops" if self._replay is not None else "empty"
        )
        return f"CpuGraph({state}, pool {self._handle.ident})"

    def recorded_ops(self) -> int:
        """How many ops a replay issues (views and allocations are not re-issued)."""
        return self._issued

    def replay_source(self) -> str:
        """The generated replay function, for debugging."""
        return str(getattr(self._replay, "__source__", ""))


def _place_intermediates(recorder: Recorder, pool: CpuPool) -> tuple[list[Block], set[int]]:
    """Move the capture's dead intermediates into the pool and rebuild their tensors there.

    A produced storage is an intermediate when nothing but the recording holds it once the
    recording lets go: the recorder drops its strong references (keeping weak ones) and looks at
    what survived; survivors are outputs (or held by the user) and stay where they are."""
    tensors, storages = recorder.tensors, recorder.storages
    # storages the capture found already there: if some are blocks of this pool (a graph of the
    # pool replayed inside this capture), this capture's intermediates must not share them
    avoid = {st.obj.data_ptr() for st in storages if not st.produced and st.obj is not None}
    weak: dict[int, Any] = {}
    for si, st in enumerate(storages):
        if st.obj is not None:
            st.nbytes = st.obj.nbytes()  # an out= op may have grown it after it was first seen
        if st.produced and not st.pinned and st.nbytes > 0 and st.obj is not None:
            weak[si] = _compat.storage_weak_ref(st.obj)
            st.obj = None
    for entry in tensors:
        if entry.storage in weak:
            entry.obj = None
    recorder.clear_index()

    dead: list[int] = []
    home: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for si, ref in weak.items():
        alive = _compat.storage_from_weak_ref(ref)
        if alive is None:
            dead.append(si)
        else:
            storages[si].obj = alive
            home[si] = (alive, 0)
    placements = pool.plan(
        [Lifetime(storages[si].nbytes, storages[si].first, storages[si].last) for si in dead], avoid
    )
    for si, placed in zip(dead, placements, strict=True):
        home[si] = (placed.block.storage, placed.offset)
    for entry in tensors:
        if entry.obj is None:
            storage, offset = home[entry.storage]
            entry.offset += offset // entry.dtype.itemsize
            entry.obj = torch.empty(0, dtype=entry.dtype).set_(
                storage, entry.offset, entry.size, entry.stride
            )
    return [p.block for p in placements], set(dead)


def _gloo() -> str:
    """The torch.distributed backend whose collectives a cpu graph captures (cpu_collectives)."""
    import torch.distributed as dist

    return "gloo" if dist.is_available() and dist.is_gloo_available() else "none"


class CpuBackend:
    """DeviceBackend and StreamBackend of the CPU."""

    type = "cpu"
    capture_computes = True

    def new_graph(self, device: torch.device) -> CpuGraph:
        return CpuGraph(device)

    def graph_pool_handle(self, device: torch.device) -> PoolHandle:
        return new_cpu_pool_handle()

    def normalize(self, device: torch.device) -> torch.device:
        return _CPU

    def pool_ident(self, pool: object, device: torch.device) -> int:
        """The id of ``pool``: a cpu PoolHandle's, or a pool id (an int) given as is."""
        if isinstance(pool, PoolHandle):
            if pool.device.type != "cpu":
                raise DeviceError(f"a pool of {pool.device} cannot be used by a graph of cpu: "
                                  "get one with graph_pool_handle('cpu')")
            pool = pool.ident
        if isinstance(pool, int) and not isinstance(pool, bool):
            return pool
        raise PolicyError(
            f"pool={pool!r} is not a pool of cpu: give a handle from "
            "npugraph_runtime.graph_pool_handle() or a graph's pool()"
        )

    def pool_bytes(self, pool: PoolHandle) -> int:
        return cpu_pool_bytes(pool)

    def synchronize(self, device: torch.device) -> None:
        """CPU work is done when Python regains control."""

    def core_limit_kind(self, device: torch.device) -> str:
        """``limit_core_num`` sets the intra-op threads."""
        return "threads"

    def capabilities(self, device: torch.device) -> dict[str, object]:
        # same keys as the accelerator backend's, so doctor and callers read one shape
        return {
            "graphs": True,
            "graph_class": "emulated (dispatch-mode recording, generated replay)",
            "core_limit": self.core_limit_kind(device),
            "task_update": False,
            "pool_sharing": True,
            "streams": "logical (ordering checked at capture)",
            "debug_dump": False,
            "capture_error_modes": CAPTURE_ERROR_MODES,
            "collectives": _gloo(),
            "threads": torch.get_num_threads(),
        }

    def new_stream(self, device: torch.device) -> CpuStream:
        return CpuStream()

    def current_stream(self, device: torch.device) -> CpuStream:
        return current_cpu_stream()

    def set_stream(self, stream: Any) -> None:
        if not isinstance(stream, CpuStream):
            raise DeviceError(f"set_stream got {stream!r}: the cpu device takes a cpu Stream")
        set_cpu_stream(stream)

    def new_event(self, device: torch.device) -> CpuEvent:
        return CpuEvent()
