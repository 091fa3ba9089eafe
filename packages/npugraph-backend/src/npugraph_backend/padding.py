"""The padded call: a call of a size not in ``capture_sizes`` runs at the next listed size.

Wraps the graph's runner (the runtime's GraphedCallable) from the backend, so the runtime keeps
keying captures by the sizes it sees: only listed sizes (and sizes above the largest) reach it.
Per call: read each padded size, pick the next capture size, copy every padded input into a
tensor of that size (pad rows: the input's pad value, or a copy of its last real row, which keeps
an index in range and a float finite), replay, write the real rows of padded mutated inputs
back, and return the outputs narrowed to the real rows (views of the capture's outputs, as an
unpadded call returns the outputs themselves). padding_analysis.py decides that this is safe."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from npugraph_backend.padding_analysis import PaddedInput, PaddingPlan


def _pad(x: torch.Tensor, spec: PaddedInput, real: Sequence[int], target: Sequence[int]
         ) -> torch.Tensor:
    shape = list(x.shape)
    for dim, sym in spec.dims:
        shape[dim] = target[sym]
    out = x.new_empty(shape)
    region = out
    for dim, sym in spec.dims:
        region = region.narrow(dim, 0, real[sym])
    region.copy_(x)
    for dim, sym in spec.dims:
        extra = target[sym] - real[sym]
        if extra == 0:
            continue
        rows = out.narrow(dim, real[sym], extra)
        if spec.pad is None:
            rows.copy_(out.narrow(dim, real[sym] - 1, 1).expand_as(rows))
        else:
            rows.fill_(spec.pad)
    return out


def _real(x: torch.Tensor, dims: Sequence[tuple[int, int, int]], real: Sequence[int]
          ) -> torch.Tensor:
    for dim, sym, factor in dims:
        x = x.narrow(dim, 0, real[sym] * factor)
    return x


class PaddedCall:
    """``fn(*args)`` with every padded size rounded up to the next capture size."""

    def __init__(self, fn: Callable[..., Any], plan: PaddingPlan) -> None:
        self.fn = fn
        self.plan = plan
        self._sizes = list(plan.sizes)
        self._largest = plan.sizes[-1]

    def _target(self, size: int) -> int:
        if size >= self._largest:
            return size  # above the largest: its own capture, as without padding
        return self._sizes[bisect.bisect_left(self._sizes, size)]

    def __call__(self, *args: Any) -> Any:
        plan = self.plan
        real = [args[slot] if dim is None else args[slot].shape[dim] for slot, dim in plan.locate]
        target = [self._target(int(v)) for v in real]
        if target == real:
            return self.fn(*args)
        padded = list(args)
        for slot, sym in plan.int_slots:
            padded[slot] = target[sym]
        for spec in plan.inputs:
            padded[spec.slot] = _pad(args[spec.slot], spec, real, target)
        outs = self.fn(*padded)
        for spec in plan.inputs:
            if spec.mutated:
                region = padded[spec.slot]
                for dim, sym in spec.dims:
                    region = region.narrow(dim, 0, real[sym])
                args[spec.slot].copy_(region)
        sliced = [
            _real(out, dims, real) if dims and isinstance(out, torch.Tensor) else out
            for out, dims in zip(outs, plan.outputs, strict=True)
        ]
        return type(outs)(sliced) if isinstance(outs, tuple) else sliced

    def __getattr__(self, name: str) -> Any:
        # the runner's own attributes (stats, captures) stay reachable through the wrapper
        return getattr(self.fn, name)
