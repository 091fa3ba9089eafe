"""The padded call: a call of a size not in ``capture_sizes`` runs at the next listed size.

Wraps the graph's runner (the runtime's GraphedCallable) from the backend, so the runtime keeps
keying captures by the sizes it sees: only listed sizes (and sizes above the largest) reach it.
Per call: read each padded size, pick the next capture size, copy every padded input into a
buffer of that size kept for it (pad rows: the input's pad value, or a copy of its last real
row, which keeps an index in range and a float finite), replay, write the real rows of padded mutated inputs
back, and return the outputs narrowed to the real rows (views of the capture's outputs, as an
unpadded call returns the outputs themselves). padding_analysis.py decides that this is safe.
With declared sizes the first call that needs one captures them all, largest first, so that one
pool holds them all (_capturing_ahead)."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from typing import Any

import torch
from npugraph_runtime import GraphedCallable
from npugraph_runtime.collector import collector_paused

from npugraph_backend._compat import first_call_analyzer_paused
from npugraph_backend.padding_plan import PaddedInput, PaddingPlan

# Dynamo specialises a size of 0 or 1: the dynamic graph never sees a batch below 2, so a
# capture size of 1 is the static graph's own capture, not this graph's
_SMALLEST = 2


class _Padded:
    """One padded input at one (real size, capture size): the buffer of the capture size and
    its views, made once, so a call costs a copy of the real rows and a fill of the pad rows."""

    __slots__ = ("buffer", "cut", "last", "parts", "real", "region")

    def __init__(self, buffer: torch.Tensor, last: list[object], spec: PaddedInput,
                 real: tuple[int, ...], target: Sequence[int]) -> None:
        self.buffer = buffer
        self.last = last  # [the real sizes of the buffer's last fill], shared by its views
        self.real = real
        region = buffer
        # a capture ahead (capture_ahead) of a size below the call's: its first rows
        self.cut = [(dim, target[sym]) for dim, sym in spec.dims if target[sym] < real[sym]]
        for dim, sym in spec.dims:
            region = region.narrow(dim, 0, min(real[sym], target[sym]))
        self.region = region
        # per padded dim: (pad rows, the last real row broadcast over them); rows of a later dim
        # span the earlier dims' pad rows too, so every pad element is written
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dim, sym in spec.dims:
            extra = target[sym] - real[sym]
            if extra > 0:
                rows = buffer.narrow(dim, real[sym], extra)
                edge = buffer.narrow(dim, real[sym] - 1, 1).expand_as(rows)
                self.parts.append((rows, edge))

    def fill(self, x: torch.Tensor, spec: PaddedInput) -> torch.Tensor:
        for dim, size in self.cut:
            x = x.narrow(dim, 0, size)
        self.region.copy_(x)
        if spec.pad is None:
            for rows, edge in self.parts:
                rows.copy_(edge)
        elif spec.mutated or self.last[0] != self.real:
            # a constant pad stays in place until a call of another real size or the graph
            # writes there
            for rows, _ in self.parts:
                rows.fill_(spec.pad)
            self.last[0] = self.real
        return self.buffer


def _real(x: torch.Tensor, dims: Sequence[tuple[int, int, int]], real: Sequence[int]
          ) -> torch.Tensor:
    for dim, sym, factor in dims:
        x = x.narrow(dim, 0, real[sym] * factor)
    return x


class PaddedCall:
    """``fn(*args)`` with every padded size rounded up to the next capture size."""

    def __init__(self, fn: GraphedCallable, plan: PaddingPlan) -> None:
        self.fn = fn
        self.plan = plan
        self._sizes = list(plan.sizes)
        self._largest = plan.sizes[-1]
        self._local = threading.local()
        # capture the sizes ahead, largest first, on the first call that needs one of them
        # (PaddingPlan.ahead): one padded size only (several would capture every combination)
        self._ahead = plan.ahead and len(plan.symbols) == 1
        self._ahead_lock = threading.Lock()

    def _target(self, size: int) -> int:
        if size >= self._largest:
            return size  # above the largest: its own capture, as without padding
        return self._sizes[bisect.bisect_left(self._sizes, size)]

    def __call__(self, *args: Any) -> Any:
        plan = self.plan
        real = [args[slot] if dim is None else args[slot].shape[dim] for slot, dim in plan.locate]
        target = [self._target(int(v)) for v in real]
        if self._ahead and target[0] <= self._largest:
            return self._capturing_ahead(real, target, args)
        return self._run(real, target, args)

    def _run(self, real: list[int], target: list[int], args: Sequence[Any]) -> Any:
        if target == real:
            return self.fn(*args)
        plan = self.plan
        padded, views = self._padded(real, target, args)
        outs: Any = self.fn(*padded)  # the graph's outputs, a sequence
        for spec, view in zip(plan.inputs, views, strict=True):
            if spec.mutated:
                args[spec.slot].copy_(view.region)
        sliced = [
            _real(out, dims, real) if dims and isinstance(out, torch.Tensor) else out
            for out, dims in zip(outs, plan.outputs, strict=True)
        ]
        return type(outs)(sliced) if isinstance(outs, tuple) else sliced

    def _capturing_ahead(self, real: list[int], target: list[int], args: Sequence[Any]) -> Any:
        """The first call that runs at a capture size captures every capture size, largest
        first: those above its own before it, its own as the call's run, those below after.
        One pool then holds them all: a smaller capture reuses what a larger one freed. Each
        other size is captured on this call's inputs cut or padded to it (pad rows as a padded
        call's) by the runtime's capture_ahead, which changes no state the caller sees."""
        with self._ahead_lock:
            if not self._ahead:
                return self._run(real, target, args)
            self._ahead = False
            sizes = [s for s in reversed(self._sizes) if s >= _SMALLEST]
            # one collector pause over every capture and the call between them (collector.py)
            with collector_paused():
                with first_call_analyzer_paused():
                    for size in (s for s in sizes if s > target[0]):
                        self.fn.capture_ahead(*self._padded(real, [size], args)[0])
                out = self._run(real, target, args)
                with first_call_analyzer_paused():
                    for size in (s for s in sizes if s < target[0]):
                        self.fn.capture_ahead(*self._padded(real, [size], args)[0])
            return out

    def _padded(self, real: list[int], target: list[int], args: Sequence[Any]
                ) -> tuple[list[Any], list[_Padded]]:
        """``args`` with every padded input in its buffer of the ``target`` sizes (its first
        real rows, then pad rows), and those buffers' views."""
        padded = list(args)
        for slot, sym in self.plan.int_slots:
            padded[slot] = target[sym]
        views = self._views(tuple(real), tuple(target), args)
        for spec, view in zip(self.plan.inputs, views, strict=True):
            padded[spec.slot] = view.fill(args[spec.slot], spec)
        return padded, views

    def _views(self, real: tuple[int, ...], target: tuple[int, ...], args: Sequence[Any]
               ) -> list[_Padded]:
        """The padded inputs of this thread for these sizes. One buffer per input and capture
        size, kept: the capture reads it where it is (no copy into the capture's own buffer),
        and calls from other threads have their own."""
        local = self._local
        cache: dict[tuple[tuple[int, ...], tuple[int, ...]], list[_Padded]] | None = getattr(
            local, "views", None)
        if cache is None:
            cache = local.views = {}
            local.buffers = {}
        views = cache.get((real, target))
        if views is None:
            buffers: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, list[object]]] = (
                local.buffers)
            views = []
            for spec in self.plan.inputs:
                x = args[spec.slot]
                kept = buffers.get((spec.slot, target))
                if kept is None:
                    shape = list(x.shape)
                    for dim, sym in spec.dims:
                        shape[dim] = target[sym]
                    kept = buffers[(spec.slot, target)] = (x.new_empty(shape), [None])
                views.append(_Padded(kept[0], kept[1], spec, real, target))
            cache[(real, target)] = views
        return views

    def __getattr__(self, name: str) -> Any:
        # the runner's own attributes (stats, captures) stay reachable through the wrapper
        return getattr(self.fn, name)
