"""Inputs that are views: overlapping, transposed, expanded, at an offset into their storage, the
same tensor twice, and a graph writing into such views. Every call's outputs and inputs equal
eager's, with and without clone_input."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

W = torch.randn(16, 16)


def _compile(fn: Any, **options: Any) -> Any:
    return torch.compile(fn, backend="npugraph_ex", dynamic=False, options=options or None)


def read_two(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return a @ W + b.sum(), a * 2, b + 1


def _views(base: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    if how == "overlapping":
        return base[0:8], base[4:12]
    if how == "transposed":
        return base[:, :8].t(), base[:8, 8:].t()
    if how == "expanded":
        return base[0:1].expand(8, 16), base[1].expand(8, 16)
    if how == "offset":
        return base.view(-1)[7:135].view(8, 16), base[3:11]
    return base[:8], base[:8]  # the same tensor twice


@pytest.mark.parametrize("clone_input", [True, False])
@pytest.mark.parametrize("how", ["overlapping", "transposed", "expanded", "offset", "same"])
def test_view_inputs_match_eager(replays_match_eager: Callable[..., None], how: str, clone_input: bool, counter: Callable[[str], int]) -> None:
    replays_match_eager(read_two, _compile(read_two, clone_input=clone_input),
                        lambda i: _views(torch.randn(16, 16), how))
    assert counter("capture_due_to_new_key_") == 1


def write_into_views(buf: torch.Tensor, cache: torch.Tensor, idx: torch.Tensor,
                     x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    buf[:, 2:6].copy_(x[:, :4])
    cache.index_copy_(0, idx, x[:2])
    return buf.sum(1), cache * 2


@pytest.mark.parametrize("clone_input", [True, False])
def test_graph_writes_into_offset_views_of_inputs(replays_match_eager: Callable[..., None], clone_input: bool,
                                                  counter: Callable[[str], int]) -> None:
    def make(i: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(12, 16)[2:10], torch.randn(20, 16)[3:13],
                torch.tensor([i % 10, (i + 3) % 10]), torch.randn(8, 16))

    replays_match_eager(write_into_views, _compile(write_into_views, clone_input=clone_input),
                        make)
    assert counter("capture_due_to_new_key_") == 1


# Fixed in the runtime (c7cf722: owned input buffers keep the caller's layout).
def test_transposed_user_input_viewed_after_transpose(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.t().reshape(-1) * 2

    replays_match_eager(f, _compile(f), lambda i: (torch.randn(4, 3).t(),))


def test_as_strided_of_a_transposed_user_input(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.as_strided((3,), (1,)) * 2

    replays_match_eager(f, _compile(f), lambda i: (torch.randn(4, 3).t(),))
