"""Outputs the caller keeps across calls: views of the inputs and of each other, the same tensor
twice, results fed back as the next call's inputs, outputs that alias each other. Every kept
output must still equal eager's output of its call after the later calls (a replay must never
write into memory an output the caller still holds)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.testing import assert_close

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


def test_input_returned_as_is() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x + y

    c = _compile(f)
    for _ in range(3):
        x, y = torch.randn(4), torch.randn(4)
        with torch.no_grad():
            a, b = c(x, y)
        assert a is x or a.data_ptr() == x.data_ptr()
        assert_close(b, x + y)


def test_view_of_input_returned() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[1:], x.t()

    c = _compile(f)
    for _ in range(3):
        x = torch.randn(3, 3)
        with torch.no_grad():
            a, b = c(x)
        assert_close(a, x[1:])
        assert_close(b, x.t())
        x.add_(1)  # eager: views see the caller's later writes
        assert_close(a, x[1:])
        assert_close(b, x.t())


@pytest.mark.parametrize("clone_output", [False, True])
def test_outputs_aliasing_each_other_stay_aliased(
        replays_match_eager: Callable[..., None], clone_output: bool) -> None:
    # under clone_output the outputs sharing memory are cloned together (fixed in the runtime,
    # 1685920), so a write into one is seen through the other, as in eager
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        return y, y.view(-1)

    c = _compile(f, clone_output=clone_output)
    replays_match_eager(f, c, lambda i: (torch.randn(2, 3),))
    for _ in range(3):
        with torch.no_grad():
            y, flat = c(torch.randn(2, 3))
        y.add_(1)
        assert_close(flat, y.view(-1))


def test_kept_outputs_stay_valid_with_clone_output_false_and_true() -> None:
    m = torch.nn.Linear(4, 4)
    for clone in (False, True):
        torch._dynamo.reset()
        c = _compile(m, clone_output=clone)
        xs = [torch.randn(2, 4) for _ in range(4)]
        with torch.no_grad():
            outs = [c(x) for x in xs]
            want = [m(x) for x in xs]
        # call 0 is the capture (its result cloned); later calls replay; a result still held when
        # its capture would replay again makes another capture of the key (clone_output=False)
        for o, w in zip(outs, want, strict=True):
            assert_close(o, w)
