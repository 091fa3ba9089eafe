"""GraphedCallable over torch.cuda graphs: the same behaviours as on the CPU, where a GPU exists."""

from __future__ import annotations

import npugraph_runtime as ngr
import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def kv_step(x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(0, pos, x)
    return cache.sum(0) * 1.5


def test_cuda_kv_cache_replays_and_recaptures_on_a_new_cache() -> None:
    dev = "cuda"
    cache_a, cache_b = torch.zeros(6, 4, device=dev), torch.zeros(6, 4, device=dev)
    eager_a, eager_b = cache_a.clone(), cache_b.clone()
    fn = ngr.make_graphed_callable(kv_step, (torch.randn(1, 4, device=dev),
                                             torch.tensor([0], device=dev), cache_a),
                                   mutated_argnums=(2,))
    for cache, eager in ((cache_a, eager_a), (cache_b, eager_b)):
        for step in range(3):
            x, pos = torch.randn(1, 4, device=dev), torch.tensor([step], device=dev)
            torch.testing.assert_close(fn(x, pos, cache), kv_step(x, pos, eager))
        torch.testing.assert_close(cache, eager)
    assert [e.reason for e in fn.events] == ["new_key", "mutated_input_change"]


def test_cuda_param_rebinding_recaptures_and_matches_eager() -> None:
    layer = torch.nn.Linear(16, 8).cuda().eval()

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w, b).relu()

    fn = ngr.make_graphed_callable(f, (torch.randn(4, 16, device="cuda"), layer.weight, layer.bias),
                                   static_argnums=(1, 2))
    x = torch.randn(4, 16, device="cuda")
    with torch.no_grad():
        fn(x, layer.weight, layer.bias)
        torch.testing.assert_close(fn(x, layer.weight, layer.bias), f(x, layer.weight, layer.bias))
        layer.weight.data = torch.randn(8, 16, device="cuda")
        torch.testing.assert_close(fn(x, layer.weight, layer.bias), f(x, layer.weight, layer.bias))
    assert [e.reason for e in fn.events] == ["new_key", "static_input_change"]
