"""A forward that re-binds one of its module's buffers on every call (``self.steps = self.steps +
1``, a running average): the buffer is a static input that is a new tensor on every call.

With frozen_parameter=True only the first and the last static input's addresses were checked,
so a buffer between them was read from the first call's tensor on every replay: wrong from the
second call (9 wrong results in 10 calls). Without it every call captured again (1.8 ms a call
against ~20 us eager). Buffers are now always checked, and a buffer that is new on every call is
copied into one of the key's own before each replay."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

CALLS = 12


class Counting(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.last = torch.nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        self.steps = self.steps + 1  # re-bound: a new tensor on every call
        self.mean = 0.9 * self.mean + 0.1 * h.mean(0)
        return self.last(h * self.steps - self.mean)


@pytest.mark.parametrize("options", [{}, {"frozen_parameter": True}, {"clone_output": True}],
                         ids=lambda o: ",".join(o) or "default")
def test_a_buffer_rebound_on_every_call_is_read_fresh(options: dict[str, Any]) -> None:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Counting()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="npugraph_ex", options=options)
    made = []
    with torch.no_grad():
        for _ in range(CALLS):
            x = torch.randn(4, 8)
            torch.testing.assert_close(compiled(x), eager(x))
            torch.testing.assert_close(model.steps, eager.steps)
            torch.testing.assert_close(model.mean, eager.mean)
            made.append(sum(v for k, v in counters["npugraph_ex"].items()
                            if k.startswith(("capture_due", "recapture_due"))))
    ours = counters["npugraph_ex"]
    assert made[0] >= 1 and not any(k.startswith("eager_") for k in ours)
    assert made[-1] == made[CALLS // 2], made  # replays from then on (one capture a call before)
    assert sum(v for k, v in ours.items() if k.startswith("copied_inputs")) >= 1
