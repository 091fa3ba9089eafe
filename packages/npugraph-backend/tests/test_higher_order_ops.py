"""Higher-order operators in compiled code: those whose bodies run the same ATen ops every call
(nested_compile_region, flex_attention, scan, a cond on a shape) are captured and replay like
eager; data-dependent control flow (cond on a tensor, while_loop) runs eagerly with a reason."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from npugraph_backend import EagerFallbackWarning

W = torch.randn(16, 16)


@torch.compiler.nested_compile_region
def _region(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ W)


def twice_through_a_region(x: torch.Tensor) -> torch.Tensor:
    return _region(_region(x)) + 1


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v)  # type: ignore[no-any-return]


def running_sum(x: torch.Tensor) -> torch.Tensor:
    from torch._higher_order_ops import scan

    return scan(lambda c, xs: (c + xs, c * 2), torch.zeros(16), x)[1]  # type: ignore[no-any-return]


def shape_branch(x: torch.Tensor) -> torch.Tensor:
    return torch.cond(x.shape[0] > 4, lambda t: t @ W, lambda t: t * -3.0, (x,))


@pytest.mark.parametrize(("fn", "shapes", "dynamic"), [
    (twice_through_a_region, [(4, 16)], False),
    (flex, [(1, 2, 8, 16)] * 3, False),
    (running_sum, [(4, 16)], False),
    (shape_branch, [(3, 16), (5, 16)], True),
])
def test_higher_order_operators_are_captured(replays_match_eager: Callable[..., None], fn: Callable[..., torch.Tensor],
                                             shapes: list[tuple[int, ...]], dynamic: bool,
                                             counter: Callable[[str], int]) -> None:
    # the CPU graph's recorder once refused every higher-order operator with a NotImplementedError
    # (eager works); it now records the ATen ops of their bodies
    compiled = torch.compile(fn, backend="npugraph_ex", dynamic=dynamic)
    if dynamic:  # one argument whose batch alternates between the two shapes
        make = lambda i: (torch.randn(*shapes[i % 2]),)  # noqa: E731
    else:
        make = lambda i: tuple(torch.randn(*s) for s in shapes)  # noqa: E731
    replays_match_eager(fn, compiled, make)
    assert counter("capture_due_to_new_key_") >= 1
    assert counter("eager_fallback_") == 0


def tensor_branch(x: torch.Tensor) -> torch.Tensor:
    return torch.cond(x.sum() > 0, lambda t: t @ W, lambda t: t * -3.0, (x,))


def grow_until(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from torch._higher_order_ops import while_loop

    return while_loop(lambda i, t: t.abs().sum() < 100, lambda i, t: (i + 1, t * 1.5),  # type: ignore[no-any-return]
                      (torch.tensor(0), x))


@pytest.mark.parametrize("fn", [tensor_branch, grow_until])
def test_data_dependent_control_flow_runs_eagerly_with_a_reason(
        replays_match_eager: Callable[..., None], fn: Callable[..., object], counter: Callable[[str], int]) -> None:
    # a capture would repeat the captured branch (or crash reading the predicate back)
    compiled = torch.compile(fn, backend="npugraph_ex")
    with pytest.warns(EagerFallbackWarning, match="data-dependent control flow"):
        replays_match_eager(fn, compiled, lambda i: ((1 if i % 2 else -1) * torch.rand(4, 16),),
                            captured=False)
    assert counter("eager_fallback_due_to_unsafe_op_") == 1
    assert counter("captured_") == 0
