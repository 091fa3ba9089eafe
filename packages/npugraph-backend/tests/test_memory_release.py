"""What frees a dropped model's weights under torch.compile: dynamo's code cache keeps the
captures of a class's forward for the process, and they hold the parameters they read in place.
The next model's first capture releases the captures nothing else references (the README's
triage section); torch._dynamo.reset() releases them all."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x).relu())


def _ours(name: str) -> int:
    return sum(v for k, v in counters["npugraph_ex"].items() if k.startswith(name))


@pytest.mark.parametrize("options", [{}, {"frozen_parameter": True}, {"capture_limit": 4},
                                     {"clone_output": True}],
                         ids=lambda o: ",".join(o) or "default")
def test_swapped_models_free_the_dropped_ones(options: dict[str, Any]) -> None:
    """Five models of one class in turn, each dropped after its calls: every output equals
    eager, each model is captured, and only the last one's weights are still alive (before,
    all five were, and capture_limit=4 made the fifth run eagerly)."""
    torch._dynamo.reset()
    counters.clear()
    weights = []
    with torch.no_grad():
        for _ in range(5):
            model = Layer().eval()
            compiled = torch.compile(model, backend="npugraph_ex", options=options)
            for _ in range(4):
                x = torch.randn(2, 16)
                torch.testing.assert_close(compiled(x), model(x))
            weights.append(weakref.ref(model.proj.weight))
            del model, compiled
            gc.collect()
    assert [w() is None for w in weights] == [True] * 4 + [False]
    assert _ours("released_orphaned_") == 4
    assert _ours("recapture_due_to_static_input_change_") == 4
    assert _ours("eager_fallback_") == 0


def test_dynamo_reset_frees_a_dropped_models_weights_and_captures() -> None:
    torch._dynamo.reset()
    counters.clear()
    model = Layer().eval()
    compiled = torch.compile(model, backend="npugraph_ex")
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 16)
            torch.testing.assert_close(compiled(x), model(x))
    assert _ours("captured_") >= 1
    weight = weakref.ref(model.proj.weight)
    del model, compiled
    torch._dynamo.reset()
    gc.collect()
    assert weight() is None
