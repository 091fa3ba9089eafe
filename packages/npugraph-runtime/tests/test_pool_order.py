"""A shared CPU pool ends near its largest capture's size whatever order the captures come in:
the planner grows a block rather than adding one when that costs fewer bytes."""

from __future__ import annotations

import npugraph_runtime as ngr
import pytest
import torch
from torch import nn

BATCHES = (128, 64, 32, 16, 8, 4, 2, 1)


class _Attention(nn.Module):
    """Intermediates of several sizes and lifetimes: projections, scores, an MLP."""

    def __init__(self, hidden: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        att = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        x = x + (att @ v).transpose(1, 2).reshape(b, s, h)
        out: torch.Tensor = x + self.down(torch.relu(self.up(x)))
        return out


def _capture_all(model: nn.Module, batches: tuple[int, ...], pool: object) -> list[tuple[object, torch.Tensor, torch.Tensor]]:
    graphs = []
    for b in batches:
        x = torch.randn(b, 16, 64)
        g = ngr.Graph("cpu")
        with torch.no_grad(), ngr.graph(g, pool=pool):
            y = model(x)
        graphs.append((g, x, y))
    return graphs


@pytest.mark.parametrize("order", ["largest_first", "smallest_first"])
def test_shared_pool_holds_at_most_1_3x_the_largest_capture(order: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Attention(), _Attention()).eval().requires_grad_(False)
    alone = ngr.graph_pool_handle("cpu")
    keep = _capture_all(model, BATCHES[:1], alone)
    largest = ngr.pool_bytes(alone)
    shared = ngr.graph_pool_handle("cpu")
    batches = BATCHES if order == "largest_first" else BATCHES[::-1]
    graphs = _capture_all(model, batches, shared)
    assert 0 < largest <= ngr.pool_bytes(shared) <= 1.3 * largest
    for g, x, _ in graphs:  # every graph replays from fresh inputs, then all are checked
        x.copy_(torch.randn_like(x))
        g.replay()  # type: ignore[attr-defined]
    for _, x, y in graphs:
        with torch.no_grad():
            torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    del keep


def test_a_grown_block_keeps_earlier_graphs_correct() -> None:
    """The smallest capture's intermediates live in a block a larger capture grows: replaying
    the small graph after the growth still gives eager's result, several times over."""
    torch.manual_seed(0)
    model = _Attention().eval().requires_grad_(False)
    shared = ngr.graph_pool_handle("cpu")
    (small, xs, ys), = _capture_all(model, (1,), shared)
    before = ngr.pool_bytes(shared)
    big = _capture_all(model, (64,), shared)
    assert ngr.pool_bytes(shared) > before
    for _ in range(5):
        xs.copy_(torch.randn_like(xs))
        small.replay()  # type: ignore[attr-defined]
        with torch.no_grad():
            torch.testing.assert_close(ys, model(xs), rtol=0, atol=0)
    del big
