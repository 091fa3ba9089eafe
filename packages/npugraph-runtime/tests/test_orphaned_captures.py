"""Captures of a dropped model (static inputs nothing else references) are released at the next
capture, freeing the weights and pool they hold; captures of live ones are kept. Every output is
compared with eager, and the counters show that captures happened and which were released."""

from __future__ import annotations

import gc
import weakref

import npugraph_runtime as ngr
import pytest
import torch
from torch._dynamo.utils import counters


def _layer(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (x @ w + b).relu()


def _counts(name: str) -> dict[str, int]:
    return {k[: -len(name) - 1]: v for k, v in counters["npugraph_ex"].items()
            if k.endswith(name) and v}


@pytest.mark.parametrize("policy", [{}, {"clone_output": True}, {"capture_limit": 4},
                                    {"clone_input": False}],
                         ids=lambda p: ",".join(p) or "default")
def test_a_dropped_models_captures_are_released_and_its_weights_freed(policy: dict) -> None:
    counters.clear()
    x0 = torch.randn(2, 8)
    g = ngr.make_graphed_callable(_layer, [x0, torch.randn(8, 8), torch.randn(8)],
                                  static_argnums=(1, 2), name="swap", **policy)
    freed = []
    with torch.no_grad():
        for _model in range(5):
            w, b = torch.randn(8, 8), torch.randn(8)
            for _ in range(4):
                x = torch.randn(2, 8)
                torch.testing.assert_close(g(x, w, b), _layer(x, w, b))
            freed.append(weakref.ref(w))
            del w, b
            gc.collect()
    # each model's captures go at the next model's first capture: only the last one is held
    assert [r() is None for r in freed] == [True] * 4 + [False]
    seen = _counts("swap")
    assert seen["released_orphaned"] == 4
    assert seen["captured"] == 1
    assert "eager_fallback_due_to_capture_limit" not in seen  # 5 models, capture_limit=4


def test_live_models_keep_their_captures() -> None:
    """Three live weight sets in turn, and an output that views a weight dropped each call
    (its reference to the weight comes and goes): nothing is released, nothing recaptured."""
    counters.clear()

    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x @ w, w.t()

    weights = [torch.randn(8, 8) for _ in range(3)]
    g = ngr.make_graphed_callable(fn, [torch.randn(2, 8), weights[0]], static_argnums=(1,),
                                  name="live")
    with torch.no_grad():
        for step in range(12):
            x, w = torch.randn(2, 8), weights[step % 3]
            got, want = g(x, w), fn(x, w)
            torch.testing.assert_close(got, want)
            del got
            gc.collect()
    seen = _counts("live")
    assert seen["captured"] == 3
    assert "released_orphaned" not in seen


def test_a_temporary_static_input_is_copied_instead_of_recaptured() -> None:
    """A fresh tensor passed as a static input on every call orphans each capture. Once a
    capture made for a new one was released before any call replayed it, the key reads that
    input from a buffer of its own, refilled every call: no capture a call, no fallback (before:
    a capture a call until capture_limit, then eager)."""
    counters.clear()
    w = torch.randn(8, 8)
    g = ngr.make_graphed_callable(lambda x, w: x @ w, [torch.randn(2, 8), w], static_argnums=(1,),
                                  name="temp", capture_limit=3)
    with torch.no_grad():
        for step in range(10):
            x = torch.randn(2, 8)
            torch.testing.assert_close(g(x, w.clone() + step), x @ (w + step))
    seen = _counts("temp")
    assert seen["copied_inputs"] == 1 and seen["released_orphaned"] <= 2, seen
    assert "eager_fallback_due_to_capture_limit" not in seen and len(g.events) <= 3


def test_a_per_call_view_of_a_live_weight_keeps_its_captures() -> None:
    """``g(x, w.t())``: each call passes a new view object of a live weight as the static input,
    so the view a capture holds is referenced by nothing else, but its memory is (``w``). Two
    keys in turn must keep one capture each; counted by the object alone, every new key
    released the other key's capture and the calls recaptured each time."""
    counters.clear()
    w = torch.randn(8, 8)
    g = ngr.make_graphed_callable(lambda x, v: x @ v, [torch.randn(2, 8), w.t()],
                                  static_argnums=(1,), name="view")
    with torch.no_grad():
        for step in range(10):
            x = torch.randn(2 + step % 2, 8)
            torch.testing.assert_close(g(x, w.t()), x @ w.t())
    seen = _counts("view")
    assert seen["captured"] == 2
    assert seen["capture_due_to_new_key"] == 2
    assert "released_orphaned" not in seen
