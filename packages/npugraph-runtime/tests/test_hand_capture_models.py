"""Hand-written capture of real models on the CPU, every result compared with eager."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import npugraph_runtime as ngr
import pytest
import torch


class TransformerBlock(torch.nn.Module):
    """Pre-norm block: causal multi-head self-attention and a GELU MLP."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (b, s, self.heads, d // self.heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


def _capture(device: str, fn: Callable[[], object]) -> tuple[Any, Any]:
    """Capture ``fn`` on ``device`` after one eager warm-up run (CUDA initialises lazily)."""
    with torch.no_grad():
        fn()
        g = ngr.Graph(device)
        with ngr.graph(g):
            out = fn()
    return g, out


def test_transformer_block_replay_matches_eager(device: str) -> None:
    model = torch.nn.Sequential(TransformerBlock(), TransformerBlock()).eval().to(device)
    x = torch.randn(2, 6, 32, device=device)
    g, y = _capture(device, lambda: model(x))
    for _ in range(2):
        x.copy_(torch.randn(2, 6, 32, device=device))
        g.replay()
        with torch.no_grad():
            torch.testing.assert_close(y, model(x))


def test_sdpa_attention_replay_matches_eager(device: str) -> None:
    q, k, v = (torch.randn(1, 4, 5, 8, device=device) for _ in range(3))

    def attention() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    g, out = _capture(device, attention)
    for t in (q, k, v):
        t.normal_()
    g.replay()
    torch.testing.assert_close(out, attention())


def test_llama_decode_step_with_static_cache_matches_eager(device: str) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).eval().to(device)
    prompt = torch.randint(0, 128, (1, 4), device=device)

    def prefilled_cache() -> Any:
        # the StaticCache allocates its tensors on first use: that must happen before capture
        cache = transformers.StaticCache(config=config, max_cache_len=16)
        with torch.no_grad():
            model(
                prompt,
                past_key_values=cache,
                cache_position=torch.arange(4, device=device),
                use_cache=True,
            )
        return cache

    cache, eager_cache = prefilled_cache(), prefilled_cache()
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    pos = torch.full((1,), 4, dtype=torch.long, device=device)
    g = ngr.Graph(device)
    with torch.no_grad(), ngr.graph(g):
        logits = model(
            ids, past_key_values=cache, cache_position=pos, position_ids=pos[None], use_cache=True
        ).logits
    ptr = logits.data_ptr()
    for step, token in enumerate((5, 17, 99)):
        ids.fill_(token)
        pos.fill_(4 + step)
        g.replay()
        with torch.no_grad():
            ref = model(
                ids.clone(),
                past_key_values=eager_cache,
                cache_position=pos.clone(),
                position_ids=pos.clone()[None],
                use_cache=True,
            ).logits
        torch.testing.assert_close(logits, ref)
        assert logits.data_ptr() == ptr
    for layer, eager_layer in zip(cache.layers, eager_cache.layers, strict=True):
        torch.testing.assert_close(layer.keys, eager_layer.keys)
        torch.testing.assert_close(layer.values, eager_layer.values)
