"""equivalents (run by pattern_fusion_pass): pow(x, 2) -> x * x and argmax -> max().indices on
CPU float tensors, bitwise the same results on adversarial data; everything else is kept."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
from npugraph_passes.equivalents import use_cheaper_equivalents
from torch.fx.experimental.proxy_tensor import make_fx

# rewritten graphs against the original: nox -s ci reruns them
# under a second kernel variant
pytestmark = pytest.mark.numerics

aten = torch.ops.aten


def _rewrite(fn: Callable[..., object], *inputs: torch.Tensor) -> tuple[int, Counter[object]]:
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    expected = gm(*inputs)
    n = use_cheaper_equivalents(gm, list(inputs), None)
    gm.graph.lint()
    gm.recompile()
    got = gm(*inputs)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape and g.stride() == e.stride()
        assert torch.equal(_bits(g), _bits(e))  # -0.0 and NaN payloads included
    return n, Counter(node.target for node in gm.graph.nodes if node.op == "call_function")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float64: torch.int64, torch.float32: torch.int32}.get(t.dtype, t.dtype))


def _adversarial(dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 3, (5, 97), generator=g).to(dtype)  # many ties
    r = torch.rand(5, 97, generator=g)
    x[r < 0.04] = float("nan")
    x[(r > 0.04) & (r < 0.08)] = float("inf")
    x[(r > 0.08) & (r < 0.12)] = float("-inf")
    x[(r > 0.12) & (r < 0.2)] = -0.0
    x[(r > 0.2) & (r < 0.25)] = 1e-40 if dtype == torch.float32 else 1e-310  # subnormals
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(5))
def test_square_and_first_max_are_rewritten_bitwise_equal(dtype: torch.dtype, seed: int) -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x.pow(2), x.argmax(-1, keepdim=True), x.argmax(0), x.t().argmax(1),
                (x * 3).pow(2.0))

    n, counts = _rewrite(fn, _adversarial(dtype, seed))
    assert n == 5
    assert counts[aten.pow.Tensor_Scalar] == 0 and counts[aten.argmax.default] == 0
    assert counts[aten.max.dim] == 3


def test_rows_that_are_all_nan_or_all_equal() -> None:
    x = torch.tensor([[float("nan")] * 4, [2.0] * 4, [-0.0, 0.0, -0.0, 0.0],
                      [1.0, float("nan"), 3.0, float("nan")]])
    n, _ = _rewrite(lambda t: (t.argmax(1), t.argmax(1, keepdim=True)), x)
    assert n == 2


def test_other_dtypes_exponents_and_flat_argmax_are_kept() -> None:
    def fn(x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x.to(torch.float16)
        return (x.pow(3), x.argmax(), i.pow(2), i.argmax(0), h.pow(2), h.argmax(0), x.pow(2.5))

    n, counts = _rewrite(fn, torch.randn(4, 6), torch.randint(-5, 5, (4, 6)))
    assert n == 0
    assert counts[aten.argmax.default] == 3 and counts[aten.max.dim] == 0 and counts[aten.mul.Tensor] == 0
