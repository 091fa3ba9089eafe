"""npugraph_ex.scope, the façade's portable stream API, inside a fullgraph-compiled function:
branches by tag on their own streams, joined by wait, equal to eager with one capture and no
cross-stream race reported."""

from __future__ import annotations

import warnings

import npugraph_runtime as ngr
import torch
from torch._dynamo.utils import counters

from npugraph_ex import scope


def test_portable_scope_api_by_tag_equal_eager_without_races() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with scope.stream("side_a"):
            a = (x @ w).tanh()
        with scope.stream("side_b"):
            b = x.exp()
        scope.wait([a, b])
        return a * b

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="npugraph_ex", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ngr.CrossStreamWarning)
        for _ in range(5):
            x, w = torch.randn(4, 4), torch.randn(4, 4)
            torch.testing.assert_close(compiled(x, w), fn(x, w))
    assert sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured_")) == 1
