"""Hand-written capture (make_graphed_callable) against eager where autograd is involved: calls
under grad mode with inputs that require grad, mixed with inference calls that replay. Every
output and every gradient is compared with eager over >= 5 calls with fresh inputs, and the
inference calls must have replayed a capture."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import npugraph_runtime as ngr
import pytest
import torch
from torch._dynamo.utils import counters

CALLS = 6
POLICIES = [{}, {"clone_output": True}, {"clone_input": False}, {"force_recapture": True}]


def _scaled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return ((x * 2) @ w).tanh()


def _shifted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x + w[0]  # saves nothing for backward: a stale autograd graph raised no error


def _grads(out: torch.Tensor, *leaves: torch.Tensor) -> list[torch.Tensor | None]:
    for t in leaves:
        t.grad = None
    out.sum().backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: ",".join(p) or "default")
@pytest.mark.parametrize("fn", [_scaled, _shifted], ids=lambda f: f.__name__)
def test_calls_needing_autograd_get_eager_gradients_and_inference_calls_replay(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], policy: dict[str, Any]
) -> None:
    """A replay's outputs carry no autograd history of the call (only, at best, the capture's):
    a backward left x.grad None, or failed with a saved tensor modified in place. A call that
    needs autograd must run eagerly; the inference calls beside it still replay."""
    counters.clear()
    w = torch.randn(8, 8, requires_grad=True)
    g = ngr.make_graphed_callable(fn, (torch.randn(4, 8), w), static_argnums=(1,), **policy)
    with pytest.warns(UserWarning, match="grad mode on and input 0 requiring grad"):
        for i in range(CALLS):
            x = torch.randn(4, 8, requires_grad=True)
            x_eager = x.detach().clone().requires_grad_(True)
            got, want = g(x, w), fn(x_eager, w)
            torch.testing.assert_close(got, want)
            assert got.requires_grad
            for a, b in zip(_grads(got, x, w), _grads(want, x_eager, w), strict=True):
                assert a is not None and b is not None, f"call {i}: a gradient is None"
                torch.testing.assert_close(a, b)
            with torch.no_grad():  # inference calls: captured once, then replayed
                x = torch.randn(4, 8)
                torch.testing.assert_close(g(x, w), fn(x, w))
    assert g.num_captures >= 1
    assert counters["npugraph_ex"][f"eager_call_due_to_requires_grad_{g.name}"] == CALLS


def test_a_static_only_callable_under_grad_mode_runs_eagerly() -> None:
    """No user tensor, so no key tells a call's grad mode: the capture itself refuses to be made
    under grad mode (a second backward through the capture's graph raised)."""
    w = torch.randn(8, 8, requires_grad=True)

    def fn(w: torch.Tensor) -> torch.Tensor:
        return (w @ w).tanh()

    g = ngr.make_graphed_callable(fn, (w,), static_argnums=(0,))
    with pytest.warns(UserWarning, match="requiring grad"):
        for _ in range(CALLS):
            got, want = g(w), fn(w)
            torch.testing.assert_close(got, want)
            for a, b in zip(_grads(got, w), _grads(want, w), strict=True):
                assert a is not None and b is not None
                torch.testing.assert_close(a, b)
    assert g.num_captures == 0
    with torch.no_grad():
        for _ in range(CALLS):
            torch.testing.assert_close(g(w), fn(w))
    assert g.num_captures == 1


def _use(out: torch.Tensor) -> str:
    """What a caller outside inference mode may do with an output: update it, save it."""
    try:
        out.add_(1)
        torch.nn.Linear(8, 8)(out).sum().backward()
    except RuntimeError as exc:
        return f"error: {exc}"[:90]
    return "ok"


@pytest.mark.parametrize("policy", POLICIES[:3], ids=lambda p: ",".join(p) or "default")
@pytest.mark.parametrize("first", ["inference_mode", "no_grad"])
def test_inference_mode_and_no_grad_calls_mixed(policy: dict[str, Any], first: str) -> None:
    """A capture made in inference mode holds inference tensors: a later call under no_grad
    raised "Inplace update to inference tensor outside InferenceMode" refilling its input
    buffer, and the outputs a replay returned were inference tensors where eager's are not
    (and the other way round)."""
    w = torch.randn(8, 8)

    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x @ w).relu(), x.sum(0)

    g = ngr.make_graphed_callable(fn, (torch.randn(4, 8), w), static_argnums=(1,), **policy)
    other = "no_grad" if first == "inference_mode" else "inference_mode"
    for i, mode in enumerate([first, other, other, first, other, first]):
        x = torch.randn(4, 8)
        with getattr(torch, mode)():
            got, want = g(x, w), fn(x, w)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
            assert a.is_inference() == b.is_inference(), f"call {i} ({mode})"
        assert _use(got[0]) == _use(want[0]), f"call {i} ({mode})"
    assert g.num_captures >= 2  # one per mode, each replayed
