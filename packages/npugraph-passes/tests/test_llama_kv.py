"""The transformers Llama decode step with a StaticCache: the passes remove the whole-cache copies
and the optimised graph computes what the unoptimised one does."""

from __future__ import annotations

import types

import pytest
import torch
from npugraph_passes import PassManager
from npugraph_passes._compat import compiled_inference_graphs
from npugraph_passes.stats import bytes_copied_per_step, graph_stats

transformers = pytest.importorskip("transformers")


def test_llama_decode_step_writes_cache_in_place_with_same_results() -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    cache = transformers.StaticCache(config=config, max_batch_size=1, max_cache_len=32)
    with torch.no_grad():  # prefill: allocates the cache tensors (lazily created in 4.5x)
        model(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=cache,
              cache_position=torch.arange(3), use_cache=True)

    def step(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True).logits

    (gm, example), = compiled_inference_graphs(step, [torch.tensor([[5]]), torch.tensor([3])])
    reference = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())
    cache_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    # the whole cache is copied back every step (transformers 5.x also writes a few small
    # bookkeeping tensors, hence >=)
    assert bytes_copied_per_step(gm, example) >= cache_bytes

    records = PassManager.from_config(types.SimpleNamespace()).run(gm, example, None)

    assert bytes_copied_per_step(gm, example) == 0
    assert graph_stats(gm)["by_target"].get("aten.index_copy_.default") == 2 * config.num_hidden_layers
    assert gm.meta["npugraph_ex_unsafe_nodes"] == []
    assert {r.name for r in records if r.changed} >= {"remove_noop_ops", "input_inplace_pass"}

    # Same logits and same cache contents as the unoptimised graph, on the real tensors.
    assert all(isinstance(t, torch.Tensor) and not _is_fake(t) for t in example)
    a = [t.clone() for t in example]
    b = [t.clone() for t in example]
    expected = reference(*a)
    got = gm(*b)
    torch.testing.assert_close(got, expected)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y, x)


def _is_fake(t: torch.Tensor) -> bool:
    return type(t).__name__ == "FakeTensor"
