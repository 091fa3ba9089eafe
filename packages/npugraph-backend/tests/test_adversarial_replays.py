"""An adversarial user's replays: several instances of one module class through one graph,
graph breaks in repeated layers, outputs held across calls, inputs that are views, threads, and
the options that change which memory a replay uses. Every output (and every mutated input) is
compared with eager over >= 6 calls with fresh inputs, and every output kept from an earlier call
is compared again after the later ones; a capture must have happened (counters)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

CALLS = 6


def _flat(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, list | tuple):
        return [t for o in out for t in _flat(o)]
    return []


@torch.no_grad()
def replays_match_eager(eager: Callable[..., object], compiled: Callable[..., object],
                        make: Callable[[int], Sequence[object]], calls: int = CALLS) -> None:
    """Each call's outputs and inputs equal eager's (given copies of the inputs); every output
    kept from an earlier call still equals what eager returned for it."""
    kept: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    for i in range(calls):
        args = make(i)
        eager_args = copy.deepcopy(args)
        want = _flat(eager(*eager_args))
        got = _flat(compiled(*args))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
        for g, w in zip(_flat(list(args)), _flat(list(eager_args)), strict=True):
            torch.testing.assert_close(g, w)  # inputs written by the graph, as eager wrote them
        kept.append((got, [w.clone() for w in want]))
        for outs, wants in kept:
            for g, w in zip(outs, wants, strict=True):
                torch.testing.assert_close(g, w)


def _compile(fn: Any, **options: Any) -> Any:
    return torch.compile(fn, backend="npugraph_ex", dynamic=False, options=options or None)


# ---- several instances of one module class through one graph --------------------------------
SHARED_NORM = nn.LayerNorm(16)


class SharedFirst(nn.Module):
    """Instances share the submodule their forward uses first."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = SHARED_NORM
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.proj(self.norm(x)))


class ClassTensorFirst(nn.Module):
    """Instances read a class-attribute tensor first (a static input they all share)."""

    table = torch.rand(16) + 0.5

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.table + torch.relu(self.proj(x))


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("cls", [SharedFirst, ClassTensorFirst])
def test_instances_sharing_their_first_static_input_replay_their_own_weights(
        cls: type[nn.Module], frozen: bool, counter: Callable[[str], int]) -> None:
    # frozen_parameter once checked only the first static input, which these instances share:
    # every layer replayed the first layer's capture
    layers = [cls().eval() for _ in range(3)]
    block = _compile(cls.forward, frozen_parameter=frozen)

    def run(f: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor], list[torch.Tensor]]:
        return lambda x: [f(layer, x) for layer in layers]

    replays_match_eager(run(cls.forward), run(block), lambda i: (torch.randn(4, 16),))
    assert counter("capture_due_to_new_key_") == 1
    assert counter("recapture_due_to_static_input_change_") >= 2


# ---- graph breaks inside repeated layers ---------------------------------------------------
class BreakingLayer(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.how = how

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        if self.how == "item":
            h = h * (1.0 if h.sum().item() > 0 else -1.0)
        elif self.how == "branch":
            h = h * 2 if h.mean() > 0.2 else h - 1
        else:
            print(end="")
        return self.b(h) + x, h


class BreakingStack(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BreakingLayer(how) for _ in range(3))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for layer in self.layers:
            x, h = layer(x)
            outs += [x, h]
        return outs


@pytest.mark.parametrize(("how", "options"), [
    ("print", {}), ("item", {"frozen_parameter": True}), ("branch", {"clone_output": True}),
    ("print", {"clone_input": False}), ("item", {"clone_input": False}),
])
def test_graph_broken_layers_keep_every_output(how: str, options: dict[str, Any],
                                               counter: Callable[[str], int]) -> None:
    # each layer's graphs feed the next ones; every layer's results are kept. Under
    # clone_input=False the second graph once adopted the first graph's result as its input
    # buffer, and the next call's refill overwrote the kept result
    model = BreakingStack(how).eval()
    replays_match_eager(model, _compile(model, **options), lambda i: (torch.randn(4, 16),))
    assert counter("capture_due_to_new_key_") >= 2
