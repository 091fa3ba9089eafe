"""A forward that re-binds its buffers on every call (``self.scale = self.scale * 0.95``) through one
FX graph that serves several module instances, or several shapes (dynamic=True): each call
released the capture of the other instance (or key), whose buffer it found dropped, so no key
ever saw its own capture go unreplayed and every call captured again (24 captures in 12 calls of
two instances). The buffers that were new, not the parameters that tell the instances apart, are
copied into buffers of each key's own; every result and buffer equals eager's."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

CALLS = 16


class Decaying(torch.nn.Module):
    """Two buffers re-bound on every call, between two parameters (frozen_parameter checks the
    first and the last static input only)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 16)
        self.register_buffer("scale", torch.ones(16))
        self.register_buffer("peak", torch.zeros(16))
        self.out = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.proj(x))
        self.scale = self.scale * 0.95
        self.peak = torch.maximum(self.peak, h.amax(0))
        return self.out(h * self.scale / (1.0 + self.peak))


def _made() -> int:
    return sum(v for k, v in counters["npugraph_ex"].items()
               if k.startswith(("capture_due", "recapture_due")))


@pytest.mark.parametrize(("instances", "sizes", "options"), [
    (2, (4,), {}), (2, (4,), {"frozen_parameter": True}), (2, (4,), {"clone_input": False}),
    (1, (2, 4, 6), {}), (2, (2, 4, 6), {}),
], ids=["two-instances", "two-instances-frozen", "two-instances-no-clone-input", "dynamic",
        "dynamic-two-instances"])
def test_rebound_buffers_of_instances_and_shapes_replay(
    instances: int, sizes: tuple[int, ...], options: dict[str, Any]
) -> None:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    models = [Decaying() for _ in range(instances)]
    eagers = [copy.deepcopy(m) for m in models]
    compiled = [torch.compile(m, backend="npugraph_ex", options=options,
                              dynamic=len(sizes) > 1) for m in models]
    made = []
    with torch.no_grad():
        for call in range(CALLS):
            for model, eager, fn in zip(models, eagers, compiled, strict=True):
                x = torch.randn(sizes[call % len(sizes)], 8)
                torch.testing.assert_close(fn(x), eager(x))
                torch.testing.assert_close(model.scale, eager.scale)
                torch.testing.assert_close(model.peak, eager.peak)
            made.append(_made())
    ours = counters["npugraph_ex"]
    assert made[0] >= 1 and not any(k.startswith("eager_") for k in ours)
    # replays from then on (a capture a call before: 8 in the last half). A tensor the caller
    # dropped may wait in a reference cycle for the collector, and be taken for alive once
    assert made[-1] - made[CALLS // 2] <= 2, made
    assert sum(v for k, v in ours.items() if k.startswith("copied_inputs")) >= 1


class Layer(torch.nn.Module):
    """A layer updating its first half's result in place across a graph break, and re-binding a
    buffer: one FX graph for the second halves of every layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        r = self.a(h)
        torch._dynamo.graph_break()
        r.add_(torch.tanh(self.b(r)))
        self.n = self.n + 1
        return r * (1 + self.n) / CALLS


def test_a_rebound_buffer_beside_a_result_updated_across_a_break_replays() -> None:
    """Under clone_output the second half's in-place input (the first half's result) is new on
    every call, and so is its re-bound buffer: the key copied one of them and captured for the
    other on every call of every layer (3 captures a call); both are copied now."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(Layer(), Layer(), Layer())
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="npugraph_ex", options={"clone_output": True})
    made = []
    with torch.no_grad():
        for _ in range(CALLS):
            x = torch.randn(4, 16)
            torch.testing.assert_close(compiled(x), eager(x))
            for ours, theirs in zip(model, eager, strict=True):
                torch.testing.assert_close(ours.n, theirs.n)
            made.append(_made())
    assert not any(k.startswith("eager_") for k in counters["npugraph_ex"])
    assert made[-1] == made[CALLS // 2], made
