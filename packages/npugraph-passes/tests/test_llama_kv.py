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


# One stacked KV buffer per model, [layers, slots, positions, dim], each layer writing its slice
# ``kc[layer]``: every way of writing into that view must stay a write of the new rows.
LAYERS, SLOTS, POSITIONS, DIM = 2, 8, 16, 8
WRITES = ("index_put_", "setitem", "select_view_index_copy_", "column")


class StackedKVDecoder(torch.nn.Module):
    """A small decoder whose layers attend over their slice of one stacked cache, read back with
    ``kc[layer][slots]`` under a position mask."""

    def __init__(self, write: str) -> None:
        super().__init__()
        self.write = write
        self.register_buffer("kc", torch.zeros(LAYERS, SLOTS, POSITIONS, DIM))
        self.register_buffer("vc", torch.zeros(LAYERS, SLOTS, POSITIONS, DIM))
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(DIM, 3 * DIM) for _ in range(LAYERS))
        self.out = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(LAYERS))

    def _store(self, cache: torch.Tensor, layer: int, slots: torch.Tensor, pos: torch.Tensor,
               new: torch.Tensor) -> None:
        if self.write == "index_put_":
            cache[layer].index_put_((slots, pos), new)
        elif self.write == "setitem":
            cache[layer, slots, pos] = new
        elif self.write == "select_view_index_copy_":
            cache.select(0, layer).view(SLOTS * POSITIONS, DIM).index_copy_(0, slots * POSITIONS + pos, new)
        else:  # every slot's column 3 at once: a select of a select of the cache
            cache[layer][:, 3] = new.mean(0)

    def forward(self, x: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        mask = torch.arange(POSITIONS)[None, :] <= pos[:, None]
        for layer in range(LAYERS):
            q, k, v = self.qkv[layer](x).chunk(3, dim=-1)
            self._store(self.kc, layer, slots, pos, k)
            self._store(self.vc, layer, slots, pos, v)
            keys, values = self.kc[layer][slots], self.vc[layer][slots]  # [batch, positions, dim]
            scores = (keys @ q[:, :, None]).squeeze(-1).masked_fill(~mask, float("-inf"))
            att = (scores.softmax(-1)[:, :, None] * values).sum(1)
            x = x + self.out[layer](att)
        return x


def _decode_inputs(step: int, batch: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    slots = torch.randperm(SLOTS, generator=g)[:batch]
    pos = torch.randint(0, POSITIONS, (batch,), generator=g)
    return [torch.randn(batch, DIM, generator=g), slots, pos]


def _counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    return graph_stats(gm)["by_target"]


@pytest.mark.parametrize("write", WRITES)
def test_stacked_kv_written_through_a_layer_view_stays_in_place(write: str) -> None:
    torch.manual_seed(0)
    model = StackedKVDecoder(write).eval()
    (gm, example), = compiled_inference_graphs(model, _decode_inputs(0))
    reference = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())
    whole_cache = 2 * LAYERS * SLOTS * POSITIONS * DIM * 4
    assert bytes_copied_per_step(gm, example) >= whole_cache  # functionalized: the buffers come back whole

    PassManager.from_config(types.SimpleNamespace()).run(gm, example, None)

    counts = _counts(gm)
    for functional in ("aten.index_put.default", "aten.index_copy.default", "aten.select_scatter.default",
                       "aten.slice_scatter.default", "aten.as_strided_scatter.default", "aten.clone.default"):
        assert counts.get(functional, 0) == 0, (functional, counts)
    in_place = {"index_put_": "aten.index_put_.default", "setitem": "aten.index_put_.default",
                "select_view_index_copy_": "aten.index_copy_.default", "column": "aten.copy_.default"}[write]
    assert counts.get(in_place) == 2 * LAYERS, counts
    if write == "column":  # eager copies the column too: [slots, dim] per buffer and layer, no more
        assert bytes_copied_per_step(gm, example) == 2 * LAYERS * SLOTS * DIM * 4
    else:
        assert bytes_copied_per_step(gm, example) == 0
        assert counts.get("aten.copy_.default", 0) == 0

    # same outputs and caches as the functional graph, step after step on the same buffers
    got_inputs = [t.clone() for t in example]
    want_inputs = [t.clone() for t in example]
    cache_at = [i for i, t in enumerate(example) if t.shape == (LAYERS, SLOTS, POSITIONS, DIM)]
    assert len(cache_at) == 2
    first = _decode_inputs(0)
    user_at = [next(i for i, t in enumerate(example) if t.shape == u.shape and t.dtype == u.dtype and torch.equal(t, u))
               for u in first]
    for step in range(4):
        fresh = _decode_inputs(step)
        for inputs in (got_inputs, want_inputs):
            for i, t in zip(user_at, fresh, strict=True):
                inputs[i] = t.clone()
        torch.testing.assert_close(gm(*got_inputs), reference(*want_inputs))
        for i in cache_at:
            torch.testing.assert_close(got_inputs[i], want_inputs[i], rtol=0, atol=0)


def test_stacked_kv_update_read_before_it_is_written_keeps_the_old_value() -> None:
    # the old slice is read after the functional update is made and before it is written back:
    # writing in place there would let the read see the new rows
    def step(kc: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        old = kc[1].clone()
        kc[1].index_put_((slots, pos), new)
        return old.sum(-1) + kc[1].sum(-1)

    inputs = [torch.randn(LAYERS, SLOTS, POSITIONS, DIM), torch.tensor([1, 5]), torch.tensor([2, 7]),
              torch.randn(2, DIM)]
    (gm, example), = compiled_inference_graphs(step, inputs)
    reference = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())
    PassManager.from_config(types.SimpleNamespace()).run(gm, example, None)
    a, b = [t.clone() for t in example], [t.clone() for t in example]
    torch.testing.assert_close(gm(*a), reference(*b))
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)


@pytest.mark.parametrize("write", WRITES)
def test_stacked_kv_decoder_replays_equal_eager_under_npugraph_ex(write: str) -> None:
    pytest.importorskip("npugraph_backend")  # the backend sits above this package
    import copy

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = StackedKVDecoder(write).eval()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="npugraph_ex")
    with torch.no_grad():
        for step in range(6):
            inputs = _decode_inputs(step)
            got = compiled(*[t.clone() for t in inputs])
            want = eager(*inputs)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(compiled_model.kc, eager.kc)
            torch.testing.assert_close(compiled_model.vc, eager.vc)
    ours = counters["npugraph_ex"]
    captures = sum(v for k, v in ours.items() if k.startswith(("capture_due", "recapture_due")))
    eager_runs = sum(v for k, v in ours.items() if k.startswith("eager_"))
    assert captures >= 1 and eager_runs == 0, dict(ours)
    assert captures <= 2, dict(ours)
    torch._dynamo.reset()
