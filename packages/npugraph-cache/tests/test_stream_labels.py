"""Objects that name a stream of the graph (``__graph_stream_label__``, the protocol
npugraph_runtime.Stream follows): their labels' values differ in every process, so the entry is
served wherever the code's streams alias alike, and refused where they do not. The streams here
are plain objects following the protocol (this package imports nothing of ours); the root's
tests/test_cache_compile_streams.py runs the same with npugraph_runtime streams in new processes."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from npugraph_cache import CacheWarning, _compat, cache_compile
from npugraph_cache.guards import aliasing
from torch._dynamo.utils import counters

pytestmark = pytest.mark.skipif(not _compat.has_aot_compile(),
                                reason=f"torch {torch.__version__}: no disk cache (no aot_compile)")

_LABELS = itertools.count(1)


class Lane:
    """A stream in all that the cache sees: a label unique to the object."""

    __graph_stream_label__ = "label"

    def __init__(self) -> None:
        self.label = f"lane_{next(_LABELS)}"


class NotALane:
    """The same, without the protocol: its label is an ordinary value the code read."""

    def __init__(self) -> None:
        self.label = f"other_{next(_LABELS)}"


class TwoLanes(torch.nn.Module):
    def __init__(self, same: bool = False, lane: type = Lane) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 6)
        self.s0 = lane()
        self.s1 = self.s0 if same else lane()

    def step(self, x: torch.Tensor) -> torch.Tensor:
        # what a graph on two streams means differs when they are one stream (no event needed)
        if self.s0.label == self.s1.label:
            return self.lin(x) * 2
        return self.lin(x) + 1


@pytest.fixture(autouse=True)
def fresh_counters() -> Iterator[None]:
    counters.clear()
    yield
    counters.clear()


def _serve(model: TwoLanes, cache: Path, calls: int = 3) -> None:
    fn = cache_compile(model.step, cache_dir=cache)
    for i in range(calls):
        x = torch.randn(4, 6)
        with torch.no_grad():
            torch.testing.assert_close(fn(x), model.step(x), msg=f"call {i}")


def test_aliasing_is_the_pattern_not_the_values() -> None:
    assert aliasing("a", "b", "a") == aliasing("x", "y", "x") == (0, 1, 0)
    assert aliasing("a", "a") != aliasing("a", "b")


def test_other_labels_with_the_same_aliasing_load_the_entry(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        _serve(TwoLanes(), tmp_path)
        _serve(TwoLanes(), tmp_path)  # new labels, as a restarted process has
    assert counters["npugraph_ex_cache"]["compiled"] == 1
    assert counters["npugraph_ex_cache"]["loaded"] == 1


def test_one_stream_for_both_does_not_load_an_entry_made_with_two(tmp_path: Path) -> None:
    _serve(TwoLanes(), tmp_path)
    with pytest.warns(CacheWarning, match=r"\[self.s0 = self.s1\], were \[self.s0\], \[self.s1\]"):
        _serve(TwoLanes(same=True), tmp_path)
    assert counters["npugraph_ex_cache"]["compiled"] == 2


def test_two_streams_do_not_take_an_entry_made_with_one(tmp_path: Path) -> None:
    _serve(TwoLanes(same=True), tmp_path)
    _serve(TwoLanes(), tmp_path)
    assert counters["npugraph_ex_cache"]["compiled"] == 2
    assert not counters["npugraph_ex_cache"]["loaded"]


def test_streams_made_one_in_a_running_process_select_another_entry(tmp_path: Path) -> None:
    """Checked on every call: the same module, its second stream replaced by its first."""
    model = TwoLanes()
    fn = cache_compile(model.step, cache_dir=tmp_path)
    for same in (False, True, False, True):
        model.s1 = model.s0 if same else Lane()
        for _ in range(2):
            x = torch.randn(4, 6)
            with torch.no_grad():
                torch.testing.assert_close(fn(x), model.step(x))
    assert counters["npugraph_ex_cache"]["compiled"] == 2


def test_a_label_without_the_protocol_stays_a_value_guard(tmp_path: Path) -> None:
    _serve(TwoLanes(lane=NotALane), tmp_path)
    with pytest.warns(CacheWarning, match=r"self.s0.label is 'other_\d+', was 'other_\d+'"):
        _serve(TwoLanes(lane=NotALane), tmp_path)
    assert counters["npugraph_ex_cache"]["compiled"] == 2
