"""Profiler ranges: named ranges in a trace while profiling, nothing at all otherwise."""

from __future__ import annotations

import torch
from npugraph_backend.dfx import ranges
from torch.profiler import ProfilerActivity, profile


def _names(prof: profile) -> set[str]:
    return {e.name for e in prof.events()}


def test_phase_is_a_named_range_while_profiling() -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof, ranges.phase(ranges.REPLAY):
        torch.ones(4).add_(1)
    assert ranges.REPLAY in _names(prof)


def test_phase_is_the_shared_no_op_without_a_profiler() -> None:
    assert ranges.phase(ranges.REPLAY) is ranges.NO_RANGE
    with ranges.phase(ranges.CAPTURE) as entered:
        assert entered is None


def test_ranged_function_shows_in_the_trace_and_returns_its_result() -> None:
    @ranges.ranged(ranges.COPY_INPUTS)
    def copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return dst.copy_(src)

    dst, src = torch.zeros(3), torch.arange(3.0)
    assert copy(dst, src) is dst
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        copy(dst, src + 1)
    assert torch.equal(dst, src + 1)
    assert ranges.COPY_INPUTS in _names(prof)
