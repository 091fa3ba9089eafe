"""What a hand-written capture returns when outputs view the inputs it uses in place, compared
with eager over several calls whose results are all kept."""

from __future__ import annotations

import npugraph_runtime as ngr
import pytest
import torch


def append_and_read(cache: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cache.add_(x)
    return cache.sum(0), cache[0]  # cache[0]: a view of the caller's cache, as in eager


def project(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x @ w, w.t()  # w.t(): a view of the caller's weight


@pytest.mark.parametrize("clone_output", [False, True])
@torch.no_grad()
def test_view_of_a_mutated_input_is_the_callers_view(clone_output: bool, device: str) -> None:
    # clone_output=True once cloned cache[0]: the kept result stopped following the cache
    cache, want_cache = torch.zeros(4, 8, device=device), torch.zeros(4, 8, device=device)
    fn = ngr.make_graphed_callable(append_and_read, (cache, torch.randn(4, 8, device=device)),
                                   mutated_argnums=(0,), clone_output=clone_output)
    kept = []
    for _ in range(6):
        x = torch.randn(4, 8, device=device)
        got, want = fn(cache, x), append_and_read(want_cache, x)
        kept.append((got, want))
        for g, w in kept:
            torch.testing.assert_close(g[0], w[0])
            torch.testing.assert_close(g[1], w[1])  # a live view of the cache, in both
    assert fn.num_captures >= 1 and fn.events[0].reason == "new_key"


@pytest.mark.parametrize("clone_output", [False, True])
@torch.no_grad()
def test_view_of_a_static_input_is_the_callers_view(clone_output: bool, device: str) -> None:
    w = torch.randn(8, 8, device=device)
    fn = ngr.make_graphed_callable(project, (torch.randn(4, 8, device=device), w),
                                   static_argnums=(1,), clone_output=clone_output)
    for _ in range(6):
        x = torch.randn(4, 8, device=device)
        out, wt = fn(x, w)
        torch.testing.assert_close(out, x @ w)
        assert wt.data_ptr() == w.data_ptr() and wt.stride() == w.t().stride()
    assert fn.num_captures >= 1
