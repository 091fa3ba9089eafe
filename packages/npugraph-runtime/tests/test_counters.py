"""The counters of a GraphedCallable exist only while positive: a check such as
``any(k.startswith("captured_") for k in counters)`` cannot pass on a counter at 0."""

from __future__ import annotations

import npugraph_runtime as ngr
import pytest
import torch
import torch.nn.functional as F
from npugraph_runtime._compat import npugraph_ex_counters


def linear_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.relu(F.linear(x, w, b)) * 2,)


@pytest.fixture(autouse=True)
def fresh_counters() -> None:
    npugraph_ex_counters().clear()


def _zeros() -> dict[str, int]:
    return {k: v for k, v in npugraph_ex_counters().items() if v <= 0}


def _run(name: str, calls: int = 3, **policies: object) -> ngr.GraphedCallable:
    layer = torch.nn.Linear(16, 8).eval()
    fn = ngr.make_graphed_callable(linear_relu, (torch.randn(4, 16), layer.weight, layer.bias),
                                   static_argnums=(1, 2), name=name, **policies)
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(4, 16)
            (out,) = fn(x, layer.weight, layer.bias)
            torch.testing.assert_close(out, linear_relu(x, layer.weight, layer.bias)[0])
            del out
    return fn


def test_force_eager_leaves_no_captured_counter() -> None:
    fn = _run("eager_only", force_eager=True)
    assert fn.num_captures == 0 and fn.fell_back
    assert dict(npugraph_ex_counters()) == {"eager_fallback_due_to_force_eager_eager_only": 1}


def test_a_captured_run_counts_only_what_happened() -> None:
    fn = _run("captured_once")
    assert fn.num_captures == 1
    assert npugraph_ex_counters()["captured_captured_once"] == 1
    assert npugraph_ex_counters()["capture_due_to_new_key_captured_once"] == 1
    assert _zeros() == {}


def test_reset_removes_the_captured_counter() -> None:
    fn = _run("reset_me")
    assert npugraph_ex_counters()["captured_reset_me"] == 1
    fn.reset()
    assert "captured_reset_me" not in npugraph_ex_counters()
    assert _zeros() == {}


def test_capture_time_is_counted_per_capture_only() -> None:
    _run("timed", calls=1)
    counts = npugraph_ex_counters()
    assert counts["captured_timed"] == 1
    first = counts["capture_ms_timed"]
    assert first >= 1  # at least 1 ms per capture: a capture that happened is never at 0
    _run("timed_replays", calls=4)  # one capture, three replays: replays add no time
    assert counts["capture_ms_timed"] == first
    assert counts["captured_timed_replays"] == 1 and counts["capture_ms_timed_replays"] >= 1
