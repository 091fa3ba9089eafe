"""transformers decoders whose layers each rebuild the same attention mask: compiled with
backend="npugraph_ex", the graph builds it once (remove_repeated_ops, run by remove_noop_ops),
squares by ``mul`` and picks the greedy token by ``max`` (equivalents, run by
pattern_fusion_pass), the replay issues each RoPE ``cat(-x2, x1)`` as the sign flip written into
its half of the output plus one copy of the other half (cpu_replay._split_cats), and every
replay matches eager over fresh tokens."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from npugraph_backend import _compat

transformers = pytest.importorskip("transformers")

LAYERS, MAX_LEN, PROMPT_LEN, STEPS = 3, 16, 4, 5


def _llama() -> Any:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )).eval()


def _qwen2() -> Any:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )).eval()


def _count_nodes(counts: list[dict[Any, int]]) -> Callable[..., None]:
    def post(gm: torch.fx.GraphModule, example_inputs: Any, config: Any) -> None:
        aten = torch.ops.aten
        targets = (aten.where.self, aten.pow.Tensor_Scalar, aten.argmax.default, aten.max.dim)
        counts.append({t: sum(n.target is t for n in gm.graph.nodes) for t in targets})

    return post


def _cpu_graphs() -> list[Any]:
    from npugraph_runtime.devices.cpu import CpuGraph

    return [o for o in gc.get_objects() if type(o) is CpuGraph and o.recorded_ops() > 0]


def _lines_of(graph: Any, op: Any) -> list[list[str]]:
    per_op, lines, _ = graph._replay.__ops__
    found = []
    for i, (step, _kind, first) in enumerate(per_op):
        last = per_op[i + 1][2] if i + 1 < len(per_op) else len(lines)
        if step.func is op:
            found.append(lines[first:last])
    return found


def _copies_a_saved_tensor(graph: Any, line: str) -> bool:
    namespace = graph._replay.__ops__[2]
    callee, _, arg = line.rstrip(")").partition("(")
    return namespace[callee].__name__ == "copy_" and isinstance(namespace.get(arg), torch.Tensor)


@pytest.fixture
def untimed_kernel_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """No replay-kernel decision of an earlier test is reused: the cat lines checked below come
    from this test's own captures (the rule picks the same kernels on any machine load)."""
    from npugraph_runtime.devices import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_DECIDED", {})


@pytest.mark.parametrize("make", [_llama, _qwen2], ids=["llama", "qwen2"])
@pytest.mark.usefixtures("untimed_kernel_choice")
@torch.no_grad()
def test_mask_is_built_once_and_replays_match_eager(make: Callable[[], Any]) -> None:
    torch.manual_seed(0)
    model = make()
    caches = [transformers.StaticCache(config=model.config, max_cache_len=MAX_LEN) for _ in range(2)]
    prompt = torch.randint(0, 128, (1, PROMPT_LEN))
    for cache in caches:
        model(input_ids=prompt, past_key_values=cache, use_cache=True,
              cache_position=torch.arange(PROMPT_LEN))

    def step(token: torch.Tensor, position: torch.Tensor, cache: Any) -> tuple[torch.Tensor, ...]:
        logits = model(input_ids=token, past_key_values=cache, use_cache=True,
                       cache_position=position).logits
        return logits.clone(), logits[:, -1].argmax(-1, keepdim=True)

    counts: list[dict[Any, int]] = []
    before = {id(g) for g in _cpu_graphs()}
    compiled = torch.compile(step, backend="npugraph_ex", fullgraph=True, dynamic=False,
                             options={"post_grad_custom_post_pass": _count_nodes(counts)})
    for i in range(STEPS):
        token = torch.randint(0, 128, (1, 1))  # fresh input every call
        position = torch.tensor([PROMPT_LEN + i])
        expected = step(token, position, caches[0])
        got = compiled(token, position, caches[1])
        torch.testing.assert_close(got[0], expected[0])
        assert torch.equal(got[1], expected[1])
        for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
            torch.testing.assert_close(b.keys, a.keys)
            torch.testing.assert_close(b.values, a.values)
    aten = torch.ops.aten
    assert len(counts) == 1
    assert counts[0][aten.where.self] == 1  # one mask for all LAYERS layers
    assert counts[0][aten.pow.Tensor_Scalar] == 0 and counts[0][aten.argmax.default] == 0
    assert counts[0][aten.max.dim] == 1
    captured = [k for k, v in _compat.counters().items() if k.startswith("captured_") and v]
    assert captured
    graphs = [g for g in _cpu_graphs() if id(g) not in before]
    assert graphs
    for graph in graphs:
        cats = _lines_of(graph, aten.cat.default)
        # per layer a q and a k rotate_half, each one copy (the negated half is written in
        # place), and the rotary embedding's cat(freqs, freqs): two copies
        assert sorted(len(c) for c in cats) == [1] * (2 * LAYERS) + [2]
        assert not any("out=" in line for c in cats for line in c)
        # the mask's arange and its two scalar_tensors read no input: copies of saved results;
        # a cache that keeps its write position (cumulative_length: 5.24.0, not 5.0.0) adds
        # one more, the arange(1) of the positions (position_ids, the mask's query positions
        # and each layer's cache write position, built once)
        constants = _lines_of(graph, aten.arange.default) + _lines_of(graph, aten.scalar_tensor.default)
        assert len(constants) == 3 + hasattr(caches[0].layers[0], "cumulative_length")
        assert all(len(c) == 1 and _copies_a_saved_tensor(graph, c[0]) for c in constants)


@torch.no_grad()
def test_gpt2_replays_match_eager() -> None:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64)).eval()

    def step(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits.clone()

    compiled = torch.compile(step, backend="npugraph_ex", fullgraph=True, dynamic=False)
    for _ in range(STEPS):
        ids = torch.randint(0, 128, (2, 8))  # fresh input every call
        torch.testing.assert_close(compiled(ids), step(ids))
    assert any(k.startswith("captured_") and v for k, v in _compat.counters().items())
