"""What frees a dropped model's weights: its captures hold the parameters they read in place, so
under torch.compile they go with dynamo's code cache (the README's triage section)."""

from __future__ import annotations

import gc
import weakref

import torch
from torch._dynamo.utils import counters


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).relu()


def test_dynamo_reset_frees_a_dropped_models_weights_and_captures() -> None:
    torch._dynamo.reset()
    counters.clear()
    model = Layer().eval()
    compiled = torch.compile(model, backend="npugraph_ex")
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 16)
            torch.testing.assert_close(compiled(x), model(x))
    assert sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured_")) >= 1
    weight = weakref.ref(model.proj.weight)
    del model, compiled
    torch._dynamo.reset()
    gc.collect()
    assert weight() is None
