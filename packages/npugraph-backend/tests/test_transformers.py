"""transformers models (tiny configs, random weights, never downloaded) decoding greedily with a
StaticCache: compiled with backend="npugraph_ex" and fullgraph=True, tokens identical to eager."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from npugraph_backend import ModeIgnoredWarning, _compat

transformers = pytest.importorskip("transformers")
# greedy tokens of a compiled (fused) graph against eager's: nox -s ci reruns them under a second
# kernel variant
pytestmark = pytest.mark.numerics

PROMPT_LEN, NEW_TOKENS, MAX_LEN = 5, 6, 16


def llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).eval()


def gpt2() -> Any:
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


def greedy_decode(model: Any, prompt: torch.Tensor, step: Callable[..., Any]) -> torch.Tensor:
    """Prefill eagerly, then NEW_TOKENS decode steps through ``step``, on a StaticCache."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=MAX_LEN)
    logits = model(input_ids=prompt, past_key_values=cache, use_cache=True,
                   cache_position=torch.arange(PROMPT_LEN)).logits
    tokens = [logits[:, -1:].argmax(-1)]
    for i in range(NEW_TOKENS - 1):
        position = torch.tensor([PROMPT_LEN + i])
        logits = step(tokens[-1], position, cache)
        tokens.append(logits[:, -1:].argmax(-1))
    return torch.cat(tokens, dim=1)


def decode_step(model: Any) -> Callable[..., Any]:
    def step(token: torch.Tensor, position: torch.Tensor, cache: Any) -> torch.Tensor:
        return model(input_ids=token, past_key_values=cache, use_cache=True,
                     cache_position=position).logits.clone()

    return step


@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama", "gpt2"])
@torch.no_grad()
def test_greedy_decode_with_static_cache_matches_eager(make: Callable[[], Any]) -> None:
    model = make()
    prompt = torch.randint(0, 128, (1, PROMPT_LEN))
    eager = greedy_decode(model, prompt, decode_step(model))
    compiled = torch.compile(decode_step(model), backend="npugraph_ex", fullgraph=True,
                             dynamic=False)
    ours = greedy_decode(model, prompt, compiled)
    assert torch.equal(ours, eager)
    assert _compat.dynamo_counters()["stats"]["unique_graphs"] == 1
    captured = [k for k, v in _compat.counters().items() if k.startswith("captured_") and v]
    assert len(captured) == 1


@torch.no_grad()
def test_generate_with_compile_config_matches_eager() -> None:
    model = llama()
    prompt = torch.randint(0, 128, (1, PROMPT_LEN))
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static",
                  pad_token_id=0)
    eager = model.generate(prompt, disable_compile=True, **kwargs)
    compile_config = transformers.CompileConfig(backend="npugraph_ex", fullgraph=True)
    compile_config._compile_all_devices = True  # transformers compiles on CUDA only by default
    config = copy.deepcopy(model.generation_config)
    config.compile_config = compile_config
    # transformers passes torch.compile mode="reduce-overhead": accepted, ignored with a warning.
    with pytest.warns(ModeIgnoredWarning, match="reduce-overhead"):
        ours = model.generate(prompt, generation_config=config, **kwargs)
    assert torch.equal(ours, eager)
    assert any(k.startswith("captured_") for k in _compat.counters())
