"""Outputs the caller keeps across calls: views of the inputs and of each other, the same tensor
twice, results fed back as the next call's inputs, outputs that alias each other. Every kept
output must still equal eager's output of its call after the later calls (a replay must never
write into memory an output the caller still holds)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

W = torch.randn(16, 16)


def _compile(fn: Any, **options: Any) -> Any:
    return torch.compile(fn, backend="npugraph_ex", dynamic=False, options=options or None)


def views_and_repeats(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    y = torch.relu(x @ W)
    return x[1:], x.t(), y, y, y[:, :4], y.t()  # views of the input, of each other, twice


def decode_step(tok: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    cache.index_copy_(0, pos, tok)
    return torch.softmax(cache @ W, -1).sum(0, keepdim=True), cache[:2]


@pytest.mark.parametrize("options", [{}, {"clone_output": True}, {"frozen_parameter": True}])
def test_outputs_viewing_inputs_and_each_other_are_kept(replays_match_eager: Callable[..., None], options: dict[str, Any],
                                                        counter: Callable[[str], int]) -> None:
    replays_match_eager(views_and_repeats, _compile(views_and_repeats, **options),
                        lambda i: (torch.randn(4, 16),))
    assert counter("capture_due_to_new_key_") == 1


@pytest.mark.parametrize("options", [{}, {"clone_output": True}])
@torch.no_grad()
def test_decode_loop_feeds_outputs_back_and_keeps_them_all(options: dict[str, Any],
                                                           counter: Callable[[str], int]) -> None:
    step = _compile(decode_step, **options)
    cache, want_cache = torch.zeros(8, 16), torch.zeros(8, 16)
    tok = want_tok = torch.randn(1, 16)
    kept = []
    for i in range(8):
        pos = torch.tensor([i])
        got, want = step(tok, cache, pos), decode_step(want_tok, want_cache, pos)
        torch.testing.assert_close(cache, want_cache)
        kept.append((got, want))
        for g, w in kept:
            torch.testing.assert_close(g, w)
        (tok, _), (want_tok, _) = got, want
    assert counter("capture_due_to_new_key_") == 1
