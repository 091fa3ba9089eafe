"""fn's writes land once per call, as in eager, on every path of the capture manager and on every
device: a new key (with 0, 1 or 3 warm-up runs), a capture for held outputs, force_recapture. On
an accelerator a new key's warm-up run is the call (its capture launches nothing and is not
replayed in that call); on the CPU a capture that is not the call's own run is undone. fn writes
a mutated input and a tensor of its own (its state); both, and every result kept, are compared
with eager over 6 calls with fresh inputs. The collectives of the same paths are counted in
test_collectives_once.py."""

from __future__ import annotations

from collections.abc import Callable

import npugraph_runtime as ngr
import pytest
import torch

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]),
]
POLICIES = [{}, {"warmup": 0}, {"warmup": 3}, {"force_recapture": True}]


def _step(device: str) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor]:
    state = torch.zeros(2, device=device)

    def step(x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        acc.mul_(0.5).add_(x)  # applied twice in one call, acc would be off
        state.add_(1)
        return acc * 2 + state.sum()

    return step, state


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "default")
@pytest.mark.parametrize("keep", [False, True], ids=["dropped", "held"])
@torch.no_grad()
def test_writes_land_once_per_call(device: str, policy: dict[str, object], keep: bool) -> None:
    step, state = _step(device)
    ref, ref_state = _step(device)
    acc, ref_acc = torch.zeros(4, 2, device=device), torch.zeros(4, 2, device=device)
    g = ngr.make_graphed_callable(step, (torch.zeros(4, 2, device=device), acc),
                                  mutated_argnums=(1,), **policy)
    kept = []
    for _ in range(6):
        x = torch.randn(4, 2, device=device)
        got, want = g(x, acc), ref(x.clone(), ref_acc)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(acc, ref_acc, rtol=0, atol=0)
        torch.testing.assert_close(state, ref_state, rtol=0, atol=0)
        if keep:
            kept.append((got, want))
        del got
    for got, want in kept:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    reasons = [e.reason for e in g.events]
    assert reasons[0] == "new_key" and g.num_captures >= 1, reasons
    if policy.get("force_recapture"):
        assert reasons.count("force_recapture") == 5, reasons
    elif keep:
        assert "held_outputs" in reasons, reasons
