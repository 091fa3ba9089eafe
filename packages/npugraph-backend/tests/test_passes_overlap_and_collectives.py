"""The passes' correctness rules compiled end to end, five calls with fresh inputs each, a capture
asserted through the counters, and a post pass that sees the optimised graph:

* views whose elements overlap (issue 10, item 3) are never written in place, so every replay
  (and force_eager) equals eager;
* collectives keep their functional form and their wait (issue 11, item 1), on a one-rank gloo
  group on 127.0.0.1 (the multi-rank replays are in the distributed tests).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

aten = torch.ops.aten


class STFTFrames(torch.nn.Module):
    """The framing of an STFT: reflect padding, overlapping frames, a window, a spectrum."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("window", torch.hann_window(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        frames = F.pad(x, (4, 4), mode="reflect").unfold(-1, 8, 4) * self.window
        return frames, torch.fft.rfft(frames).abs()


def _sliding(t: torch.Tensor) -> torch.Tensor:
    return (t.exp().unfold(0, 3, 1) * 2).sum(-1)


def _as_strided(x: torch.Tensor) -> torch.Tensor:
    return x.exp().as_strided((3, 3), (1, 1)).neg()


class Targets:
    """A post pass that records the ops of the optimised graph."""

    def __init__(self) -> None:
        self.seen: list[object] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
        self.seen += [n.target for n in gm.graph.nodes if n.op == "call_function"]


CASES: list[tuple[str, Callable[[], Callable[..., Any]], Callable[[], list[torch.Tensor]]]] = [
    ("stft_framing", STFTFrames, lambda: [torch.randn(2, 64)]),
    ("sliding_unfold", lambda: _sliding, lambda: [torch.randn(10)]),
    ("overlapping_as_strided", lambda: _as_strided, lambda: [torch.randn(9)]),
]


@pytest.mark.parametrize("force_eager", [False, True], ids=["replay", "force_eager"])
@pytest.mark.parametrize(("name", "make", "inputs"), CASES, ids=[c[0] for c in CASES])
@torch.no_grad()
def test_overlapping_views_equal_eager_on_every_call(
    name: str, make: Callable[[], Callable[..., Any]], inputs: Callable[[], list[torch.Tensor]],
    force_eager: bool, counter: Callable[[str], int],
) -> None:
    fn = make()
    seen = Targets()
    compiled = torch.compile(fn, backend="npugraph_ex", fullgraph=True, dynamic=False,
                             options={"force_eager": force_eager, "post_grad_custom_post_pass": seen})
    for _ in range(5):
        args = inputs()
        torch.testing.assert_close(compiled(*args), fn(*args))
    assert seen.seen, "the passes never ran"
    assert not {aten.mul_.Tensor, aten.neg_.default} & set(seen.seen)
    assert counter("captured_") == (0 if force_eager else 1)


@pytest.fixture
def one_rank_gloo() -> Iterator[None]:
    """A one-rank gloo group; its store picks a free loopback port itself (port 0)."""
    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed with gloo, and no process group in this process yet")
    timeout = datetime.timedelta(seconds=30)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1, timeout=timeout)
    yield
    dist.destroy_process_group()


def _all_reduce_then_relu(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    dist.all_reduce(y)
    return (y + 1).relu()


@pytest.mark.usefixtures("one_rank_gloo")
@torch.no_grad()
def test_in_place_all_reduce_stays_functional_and_replays_like_eager(counter: Callable[[str], int]) -> None:
    seen = Targets()
    compiled = torch.compile(_all_reduce_then_relu, backend="npugraph_ex", fullgraph=True, dynamic=False,
                             options={"post_grad_custom_post_pass": seen})
    for _ in range(5):
        x = torch.randn(4, 8)
        torch.testing.assert_close(compiled(x), _all_reduce_then_relu(x.clone()))
    c10d = torch.ops._c10d_functional
    assert c10d.all_reduce.default in seen.seen and c10d.wait_tensor.default in seen.seen
    assert c10d.all_reduce_.default not in seen.seen
    assert aten.relu_.default in seen.seen  # the rest of the graph is still re-inplaced
    assert counter("captured_") == 1
