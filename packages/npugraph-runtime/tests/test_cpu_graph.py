"""The emulated CPU device graph: capture, replay, side effects, unsafe ops, bad usage."""

from __future__ import annotations

import pytest
import torch

import npugraph_runtime as ngr


def capture(fn, *args, **kw):  # type: ignore[no-untyped-def]
    g = ngr.Graph("cpu")
    with torch.no_grad(), ngr.graph(g, **kw):
        out = fn(*args)
    return g, out


def test_mlp_replay_matches_eager_after_new_inputs(small_mlp: torch.nn.Module) -> None:
    x = torch.randn(4, 32)
    g, y = capture(small_mlp, x)
    for _ in range(3):
        x.copy_(torch.randn(4, 32))
        g.replay()
        with torch.no_grad():
            torch.testing.assert_close(y, small_mlp(x), rtol=0, atol=0)
