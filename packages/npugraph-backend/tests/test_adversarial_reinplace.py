"""A detached view of a re-inplaced intermediate (``buf.add_(y.detach() * s)`` after
``y = linear(x) + bias``): the intermediates pass made ``y + bias`` write into the linear's
output, left ``detach(y)`` in the old storage's bookkeeping, and then made ``detach(y) * s``
write into that detached view, i.e. into the returned ``y``. Every call returned
``y * (1 + s)``-ish values, replay and first call alike."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch


class RunningMean(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("mean", torch.zeros(4, 16))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x) + bias
        self.mean.add_(y.detach() * 0.1)
        return y, self.mean


@pytest.mark.parametrize("inplace_pass", [True, False])
@torch.no_grad()
def test_detached_view_of_a_reinplaced_intermediate_is_not_written(
    inplace_pass: bool, counter: Callable[[str], int]
) -> None:
    model = RunningMean().eval()
    twin = copy.deepcopy(model)
    step = torch.compile(model, backend="npugraph_ex", fullgraph=True,
                         options={"inplace_pass": inplace_pass})
    kept = []
    for _ in range(6):
        x, bias = torch.randn(4, 16), torch.randn(16)
        got, mean = step(x, bias)
        want, want_mean = twin(x, bias)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(mean, want_mean)
        kept.append((got, want.clone()))
    for got, want in kept:
        torch.testing.assert_close(got, want)
    assert counter("captured_") >= 1
