"""The backend on CUDA graphs (skipped without an NVIDIA GPU)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@torch.no_grad()
def test_cuda_model_is_captured_and_replays_like_eager(counter: Callable[[str], int]) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).cuda()
    f = torch.compile(model, backend="npugraph_ex", fullgraph=True, dynamic=False)
    for _ in range(4):
        x = torch.randn(4, 16, device="cuda")
        torch.testing.assert_close(f(x), model(x))
    assert counter("capture_due_to_new_key_") == 1


@torch.no_grad()
def test_cuda_kv_cache_index_copy_in_place(counter: Callable[[str], int]) -> None:
    def step(x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, x)
        return torch.softmax(x @ cache.T, dim=-1) @ cache

    f = torch.compile(step, backend="npugraph_ex", fullgraph=True, dynamic=False)
    cache = torch.zeros(8, 4, device="cuda")
    ref = cache.clone()
    for i in range(4):
        x, pos = torch.randn(1, 4, device="cuda"), torch.tensor([i], device="cuda")
        torch.testing.assert_close(f(x, pos, cache), step(x, pos, ref))
        torch.testing.assert_close(cache, ref)
    assert counter("captured_") == 1


@torch.no_grad()
def test_cuda_user_pool_shared_through_use_graph_pool() -> None:
    import npugraph_runtime

    pool = npugraph_runtime.graph_pool_handle("cuda")
    f = torch.compile(lambda x: x.sin() * 2, backend="npugraph_ex", fullgraph=True,
                      dynamic=False, options={"use_graph_pool": pool})
    for _ in range(3):
        x = torch.randn(64, device="cuda")
        torch.testing.assert_close(f(x), x.sin() * 2)
