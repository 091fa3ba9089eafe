"""Every test starts with a fresh Dynamo cache and empty npugraph_ex counters."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from npugraph_backend import _compat


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    _compat.dynamo_reset()
    _compat.dynamo_counters().clear()
    torch.manual_seed(0)
    yield
    _compat.dynamo_reset()


def _counter(prefix: str) -> int:
    return sum(v for k, v in _compat.counters().items() if k.startswith(prefix))


@pytest.fixture
def counter() -> Callable[[str], int]:
    """The sum of the npugraph_ex counters whose name starts with a prefix."""
    return _counter


def _compiles() -> int:
    return int(_compat.dynamo_counters()["stats"]["unique_graphs"])


@pytest.fixture
def compiles() -> Callable[[], int]:
    """Graphs dynamo compiled: a recompile is one more (torch 2.13 leaves counters["recompiles"]
    empty, so a test reading it would pass whatever happened)."""
    return _compiles


def _flat(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, list | tuple):
        return [t for o in out for t in _flat(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _flat(o)]
    return []


@torch.no_grad()
def _replays_match_eager(eager: Callable[..., object], compiled: Callable[..., object],
                         make: Callable[[int], Sequence[object]], calls: int = 6,
                         *, captured: bool = True) -> None:
    kept: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    for i in range(calls):
        args = make(i)
        eager_args = copy.deepcopy(args)
        want = _flat(eager(*eager_args))
        got = _flat(compiled(*args))
        assert len(got) == len(want), f"call {i}: {len(got)} outputs, eager {len(want)}"
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, msg=lambda m, i=i: f"call {i}: {m}")
        for g, w in zip(_flat(list(args)), _flat(list(eager_args)), strict=True):
            torch.testing.assert_close(g, w, msg=lambda m, i=i: f"call {i} (inputs after): {m}")
        kept.append((got, want))
        for j, (outs, wants) in enumerate(kept):
            for g, w in zip(outs, wants, strict=True):
                torch.testing.assert_close(g, w, msg=lambda m, i=i, j=j: f"call {j} kept to {i}: {m}")
    if captured:  # else the comparison may have been of eager against eager
        assert _counter("captured_") > 0, f"nothing was captured: {dict(_compat.counters())}"
        assert _counter("eager_fallback_") == 0, f"an eager fallback: {dict(_compat.counters())}"


@pytest.fixture
def replays_match_eager() -> Callable[..., None]:
    """``(eager, compiled, make, calls=6)``: each of ``calls`` calls on fresh args ``make(i)``
    (eager gets a deep copy) returns eager's outputs and leaves the args as eager left them, and
    every output kept from an earlier call still equals eager's output of that call (a view of
    a buffer the later calls update changes in both); with ``captured`` (the default), a graph
    was captured and none fell back to eager, so the replays were compared, not eager twice."""
    return _replays_match_eager
