"""Adversarial user scenarios on compiled models that replay like eager (kept as regression
tests): round-robin requests with their own StaticCache, several batch sizes sharing one FX graph's
pool replayed interleaved while every output is held, weights reloaded in place after compile.
Every result is compared with eager over >= 5 calls with fresh inputs; counters prove a capture."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

PROMPT, MAX_LEN, VOCAB = 5, 24, 128


def _config(cls: Any) -> Any:
    return cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _caches(model: Any, batch: int) -> tuple[Any, Any]:
    """Two StaticCaches prefilled eagerly with one prompt: one for the compiled steps, one for eager."""
    prompt = torch.randint(0, VOCAB, (batch, PROMPT))
    pair = []
    for _ in range(2):
        cache = transformers.StaticCache(config=model.config, max_cache_len=MAX_LEN)
        model(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(PROMPT))
        pair.append(cache)
    return pair[0], pair[1]


def _decode(model: Any, step: Any, caches: dict[int, tuple[Any, Any]], steps: int) -> None:
    """``steps`` rounds over the caches in turn with fresh tokens; every logits tensor of ours is
    kept until the end, then compared with eager's."""
    held = []
    for i in range(steps):
        for batch, (ours, eager) in caches.items():
            tok, pos = torch.randint(0, VOCAB, (batch, 1)), torch.tensor([PROMPT + i])
            held.append((step(input_ids=tok, past_key_values=ours, cache_position=pos).logits,
                         model(input_ids=tok, past_key_values=eager, cache_position=pos).logits))
    for got, want in held:
        torch.testing.assert_close(got, want)
    for ours, eager in caches.values():
        torch.testing.assert_close(ours.layers[-1].keys, eager.layers[-1].keys)


@torch.no_grad()
def test_round_robin_requests_with_their_own_static_caches(counter: Callable[[str], int]) -> None:
    model = transformers.LlamaForCausalLM(_config(transformers.LlamaConfig)).eval()
    step = torch.compile(model, backend="npugraph_ex", fullgraph=True)
    requests = [_caches(model, 1) for _ in range(3)]
    held = []
    for i in range(5):
        for ours, eager in requests:
            tok, pos = torch.randint(0, VOCAB, (1, 1)), torch.tensor([PROMPT + i])
            held.append((step(input_ids=tok, past_key_values=ours, cache_position=pos).logits,
                         model(input_ids=tok, past_key_values=eager, cache_position=pos).logits))
    for got, want in held:  # no request's step changed another request's kept logits or cache
        torch.testing.assert_close(got, want)
    for ours, eager in requests:
        torch.testing.assert_close(ours.layers[-1].values, eager.layers[-1].values)
    assert counter("captured_") >= 1
    # each request's cache gets its own capture once, not a recapture every call
    assert counter("recapture_due_to_mutated_input_change_") == 2


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@torch.no_grad()
def test_batch_sizes_interleaved_with_every_output_held(
    dynamic: bool, counter: Callable[[str], int]
) -> None:
    model = transformers.Qwen2ForCausalLM(_config(transformers.Qwen2Config)).eval()
    step = torch.compile(model, backend="npugraph_ex", dynamic=dynamic)
    # largest first: the later, smaller captures share (and may grow) the pool's blocks
    _decode(model, step, {b: _caches(model, b) for b in (4, 1, 2)}, 5)
    assert counter("capture_due_to_held_outputs_") >= 3


@pytest.mark.parametrize("frozen", [False, True], ids=["checked", "frozen_parameter"])
@torch.no_grad()
def test_weights_reloaded_in_place_after_compile(frozen: bool, counter: Callable[[str], int]) -> None:
    def make() -> Any:
        return transformers.LlamaForCausalLM(_config(transformers.LlamaConfig)).eval()

    model, sources = make(), [make().state_dict() for _ in range(3)]
    step = torch.compile(model, backend="npugraph_ex", options={"frozen_parameter": frozen})
    for i in range(6):
        if i >= 1:  # same parameter addresses, new values: a replay must read them
            model.load_state_dict(sources[i % 3])
        ids = torch.randint(0, VOCAB, (2, 7))
        torch.testing.assert_close(step(input_ids=ids, use_cache=False).logits,
                                   model(input_ids=ids, use_cache=False).logits)
    assert counter("captured_") >= 1
    assert counter("recapture_due_to_") == 0


def _decay(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    state.mul_(0.5).add_(1)
    return x * 2 + state.sum()


@torch.no_grad()
def test_mutated_input_and_a_disjoint_view_of_its_storage(counter: Callable[[str], int]) -> None:
    # two non-overlapping views of one tensor, one written in place: AOT passes them apart (no
    # synthetic base), and the replay must run like eager rather than refuse them
    step = torch.compile(_decay, backend="npugraph_ex")
    for _ in range(6):
        ours = torch.randn(4, 4)
        eager = ours.clone()
        torch.testing.assert_close(step(ours[:2], ours[2:]), _decay(eager[:2], eager[2:]))
        torch.testing.assert_close(ours, eager)
    assert counter("captured_") == 1
