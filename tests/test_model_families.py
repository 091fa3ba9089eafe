"""Model families beyond decoder-only Llama, compiled with backend="npugraph_ex" and compared with
an eager twin on every call (fresh inputs, >= 6 calls, kept outputs checked again after later
calls), with a capture asserted through counters["npugraph_ex"]: mixture-of-experts routing
(topk, data-dependent dispatch), encoders and an encoder-decoder with a static cross-attention
cache, batched decode with left padding, beam search reordering a static cache, bf16/fp16,
sliding-window attention and rotary scaling. transformers models are built from a config with
random weights (nothing downloaded). Set NPUGRAPH_EX_SLOW_TESTS=1 for the slower variants."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

transformers = pytest.importorskip("transformers")

import npugraph_ex  # noqa: E402
from npugraph_ex.hf import compile_config  # noqa: E402

slow = pytest.mark.skipif(not os.environ.get("NPUGRAPH_EX_SLOW_TESTS"),
                          reason="slow: set NPUGRAPH_EX_SLOW_TESTS=1")
CALLS = 6
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             pad_token_id=0)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch.compiler.reset()
    counters.clear()
    yield
    torch.compiler.reset()
    counters.clear()


def _count(prefix: str) -> int:
    return sum(v for k, v in counters["npugraph_ex"].items() if k.startswith(prefix))


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat(o)]
    if hasattr(out, "self_attention_cache"):  # EncoderDecoderCache
        return _flat(out.self_attention_cache) + _flat(out.cross_attention_cache)
    if hasattr(out, "layers"):  # a transformers Cache
        return [t for layer in out.layers for t in (layer.keys, layer.values)
                if isinstance(t, torch.Tensor)]
    return []


def _close(got: Any, want: Any, tol: float = 1e-4) -> None:
    g, w = _flat(got), _flat(want)
    assert len(g) == len(w) and g
    for a, b in zip(g, w, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def _compare(make: Callable[[int], tuple[Any, ...]], eager: Callable[..., Any],
             compiled: Callable[..., Any], calls: int = CALLS) -> None:
    """Every call's outputs equal eager's, and every kept output still does after later calls."""
    kept: list[tuple[Any, list[torch.Tensor]]] = []
    with torch.no_grad():
        for i in range(calls):
            args = make(i)
            want, got = eager(*args), compiled(*args)
            _close(got, want)
            kept.append((got, [t.clone() for t in _flat(want)]))
            for old, old_want in kept:
                _close(old, old_want)


def _left_padded(batch: int, length: int, shift: int) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(1, batch):
        mask[b, : (b + shift) % 4] = 0
    return mask


class StaticMoE(torch.nn.Module):
    """Top-2 routing with a capturable dispatch (vLLM's naive MoE shape): tokens sorted by expert,
    scattered into fixed-capacity expert buckets, batched expert MLPs, index_add_ back; the
    per-expert load is counted into a buffer the graph mutates."""

    def __init__(self, dim: int = 16, experts: int = 4, ffn: int = 24) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(dim, experts, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(experts, dim, ffn) * 0.2)
        self.w2 = torch.nn.Parameter(torch.randn(experts, ffn, dim) * 0.2)
        self.experts = experts
        self.register_buffer("load", torch.zeros(experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x.reshape(-1, x.shape[-1])
        logits = self.gate(h)
        weight, chosen = torch.topk(logits.softmax(-1), 2, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // 2
        counts = torch.zeros(self.experts, dtype=torch.long).scatter_add_(0, flat, torch.ones_like(flat))
        self.load.add_(counts.to(self.load.dtype))
        expert = flat[order]
        slot = torch.arange(flat.numel()) - (torch.cumsum(counts, 0) - counts)[expert]
        buckets = h.new_zeros(self.experts, flat.numel(), h.shape[-1])
        buckets[expert, slot] = h[token]
        y = torch.bmm(torch.nn.functional.silu(torch.bmm(buckets, self.w1)), self.w2)
        out = torch.zeros_like(h).index_add_(0, token, y[expert, slot] * weight.reshape(-1)[order, None])
        return out.reshape(x.shape), logits


@pytest.mark.parametrize(("dynamic", "options"), [
    (False, {}),
    (True, {"frozen_parameter": True, "clone_input": False}),
    pytest.param(False, {"clone_output": True, "use_graph_pool": npugraph_ex.graph_pool_handle("cpu")},
                 marks=slow),
])
def test_moe_dispatch_two_instances_match_eager(dynamic: bool, options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    models = [StaticMoE().eval() for _ in range(2)]
    twins = [copy.deepcopy(m) for m in models]
    forward = torch.compile(StaticMoE.forward, backend="npugraph_ex", dynamic=dynamic, options=options)

    def make(i: int) -> tuple[int, torch.Tensor]:
        return i % 2, torch.randn(2, 5 if not dynamic else 3 + i % 3, 16)

    _compare(make, lambda k, x: (*twins[k](x), twins[k].load.clone()),
             lambda k, x: (*forward(models[k], x), models[k].load.clone()), calls=8)
    assert _count("captured_") >= 2


def _moe(name: str) -> tuple[Any, Any]:
    if name == "mixtral":
        return transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2), \
            transformers.MixtralForCausalLM
    return transformers.Qwen2MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=24, shared_expert_intermediate_size=32), \
        transformers.Qwen2MoeForCausalLM


@pytest.mark.parametrize("family", [pytest.param("mixtral", marks=slow), "qwen2_moe"])
def test_hf_moe_forward_with_router_outputs_two_instances(family: str) -> None:
    # The expert loop breaks the graph at each data-dependent expert index: the pieces between
    # the breaks are captured, and two instances of one class share those graphs.
    config, cls = _moe(family)
    torch.manual_seed(0)
    models = [cls(config).eval() for _ in range(2)]
    twins = [copy.deepcopy(m) for m in models]
    compiled = [torch.compile(m, backend="npugraph_ex", options={"frozen_parameter": True})
                for m in models]

    def make(i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        ids = torch.randint(1, 64, (2, 5))
        return i % 2, ids, _left_padded(2, 5, i)

    def call(ms: list[Any]) -> Callable[..., Any]:
        def run(k: int, ids: torch.Tensor, mask: torch.Tensor) -> Any:
            out = ms[k](input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100),
                        output_router_logits=True, use_cache=False)
            return out.logits, out.loss, out.aux_loss, out.router_logits
        return run

    _compare(make, call(twins), call(compiled))
    assert _count("captured_") >= 2


def test_moe_routing_in_one_graph_runs_eagerly_with_a_counted_reason() -> None:
    # With dynamo capturing .item()/nonzero, the expert loop's data-dependent shapes sit inside a
    # graph: that graph cannot be captured, runs eagerly with a counted reason, and the rest replays.
    import torch._dynamo.config as dynamo_config

    config, cls = _moe("mixtral")
    torch.manual_seed(0)
    model = cls(config).eval()
    twin = copy.deepcopy(model)
    with dynamo_config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(model, backend="npugraph_ex")
        _compare(lambda i: (torch.randint(0, 64, (2, 5)),),
                 lambda ids: twin(input_ids=ids, use_cache=False).logits,
                 lambda ids: compiled(input_ids=ids, use_cache=False).logits)
    assert _count("eager_fallback_due_to_unsafe_op") >= 1
    assert _count("captured_") >= 1


def _decode(model: Any, twin: Any, cache: Any, twin_cache: Any, step: Callable[..., Any],
            batch: int, prompt: int, steps: int, tol: float = 1e-4) -> None:
    """Eager prefill on both, then compiled decode steps vs eager ones with a left-padded batch:
    a fresh copy of the cache-length attention mask and per-row position_ids each step."""
    mask = _left_padded(batch, prompt + steps, 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ids = torch.randint(1, 64, (batch, prompt))
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        firsts = [m(input_ids=ids, attention_mask=mask[:, :prompt], position_ids=pos[:, :prompt],
                    past_key_values=c, cache_position=torch.arange(prompt)).logits
                  for m, c in ((model, cache), (twin, twin_cache))]
        tok = firsts[1][:, -1:].argmax(-1)
        for s in range(steps):
            n = prompt + s
            kwargs = dict(input_ids=tok, attention_mask=mask.clone(),
                          position_ids=pos[:, n : n + 1].clone(), cache_position=torch.tensor([n]))
            got = step(past_key_values=cache, **kwargs).logits
            want = twin(past_key_values=twin_cache, **kwargs).logits
            _close(got, want, tol)
            _close(cache, twin_cache, tol)
            kept.append((got, want.clone()))
            for old, old_want in kept:
                _close(old, old_want, tol)
            tok = want[:, -1:].argmax(-1)


@slow
def test_qwen2_moe_static_cache_decode_left_padded() -> None:
    config, cls = _moe("qwen2_moe")
    torch.manual_seed(1)
    model = cls(config).eval()
    twin = copy.deepcopy(model)
    caches = [transformers.StaticCache(config=config, max_batch_size=3, max_cache_len=10) for _ in range(2)]
    step = torch.compile(model.forward, backend="npugraph_ex", dynamic=None, options={"clone_output": True})
    _decode(model, twin, *caches, step, batch=3, prompt=4, steps=6)
    assert _count("captured_") >= 2


@pytest.mark.parametrize(("family", "dtype", "extra"), [
    ("mistral", torch.bfloat16, {"sliding_window": 3}),
    ("llama", torch.float32, {"max_position_embeddings": 8,
                              "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    pytest.param("qwen2", torch.float16, {"use_sliding_window": True, "sliding_window": 3,
                                          "max_window_layers": 1, "num_hidden_layers": 2},
                 marks=slow),
    pytest.param("llama", torch.bfloat16, {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}, marks=slow),
])
def test_decode_dtypes_sliding_window_and_rope_scaling(family: str, dtype: torch.dtype,
                                                        extra: dict[str, Any]) -> None:
    # The sliding window (3) and the dynamic rope's base (8 positions) are both passed during the
    # decode, so the window's mask and the re-computed inv_freq are part of what is compared.
    cfg_cls, cls = {"mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
                    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    config = cfg_cls(**{**SMALL, **extra})
    torch.manual_seed(2)
    model = cls(config).eval().to(dtype)
    twin = copy.deepcopy(model)
    caches = [transformers.StaticCache(config=config, max_batch_size=3, max_cache_len=11, dtype=dtype)
              for _ in range(2)]
    step = torch.compile(model.forward, backend="npugraph_ex", dynamic=None)
    _decode(model, twin, *caches, step, batch=3, prompt=5, steps=6,
            tol=1e-4 if dtype == torch.float32 else 3e-2)
    assert _count("captured_") >= 2


@pytest.mark.parametrize(("family", "dynamic", "options"), [
    ("bert", True, {"clone_input": False}),
    pytest.param("roberta", False, {"frozen_parameter": True}, marks=slow),
    ("qwen2", False, {"clone_output": True}),
])
def test_sequence_classification_with_padding_changing_per_call(
        family: str, dynamic: bool, options: dict[str, Any]) -> None:
    # BERT/RoBERTa: right padding whose length changes per call; Qwen2 pools the last non-pad
    # token found from the ids (a data-dependent gather) and computes the loss.
    if family == "qwen2":
        config, cls = transformers.Qwen2Config(**SMALL, num_labels=3), transformers.Qwen2ForSequenceClassification
    else:
        cfg_cls, cls = {"bert": (transformers.BertConfig, transformers.BertForSequenceClassification),
                        "roberta": (transformers.RobertaConfig, transformers.RobertaForSequenceClassification)}[family]
        config = cfg_cls(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         intermediate_size=48, max_position_embeddings=70, num_labels=3,
                         pad_token_id=0)
    torch.manual_seed(3)
    models = [cls(config).eval() for _ in range(2)]
    twins = [copy.deepcopy(m) for m in models]
    compiled = [torch.compile(m, backend="npugraph_ex", dynamic=dynamic, options=options) for m in models]

    def make(i: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        length = 7 if not dynamic else 5 + i % 3
        lens = torch.randint(1, length + 1, (4,))
        mask = (torch.arange(length)[None] < lens[:, None]).long()
        ids = torch.randint(2, 64, (4, length)).masked_fill(mask == 0, 0)
        return i % 2, ids, mask, torch.randint(0, 3, (4,))

    def call(ms: list[Any]) -> Callable[..., Any]:
        def run(k: int, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> Any:
            out = ms[k](input_ids=ids, attention_mask=mask, labels=labels)
            return out.logits, out.loss
        return run

    _compare(make, call(twins), call(compiled), calls=8)
    assert _count("captured_") >= 2


def _t5() -> tuple[Any, Any]:
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=1,
                                   num_decoder_layers=1, num_heads=4, decoder_start_token_id=0,
                                   pad_token_id=0, eos_token_id=63)
    torch.manual_seed(4)
    return config, transformers.T5ForConditionalGeneration(config).eval()


def test_t5_decode_with_static_self_and_cross_attention_caches() -> None:
    # Step 0 fills the cross-attention cache (one graph), later steps read it (another graph).
    config, model = _t5()
    twin = copy.deepcopy(model)
    step = torch.compile(model.forward, backend="npugraph_ex")
    batch = 2
    with torch.no_grad():
        for prompt_seed in range(2):  # a second request: new caches, new encoder outputs
            gen = torch.Generator().manual_seed(prompt_seed)
            ids = torch.randint(2, 64, (batch, 6), generator=gen)
            mask = torch.ones(batch, 6, dtype=torch.long)
            mask[1, 4:] = 0
            caches = [transformers.EncoderDecoderCache(
                transformers.StaticCache(config=config, max_batch_size=batch, max_cache_len=12),
                transformers.StaticCache(config=config, max_batch_size=batch, max_cache_len=6))
                for _ in range(2)]
            encoded = [m.get_encoder()(input_ids=ids, attention_mask=mask) for m in (model, twin)]
            tok = torch.zeros(batch, 1, dtype=torch.long)
            kept: list[tuple[torch.Tensor, torch.Tensor]] = []
            for s in range(CALLS):
                kwargs = dict(attention_mask=mask, decoder_input_ids=tok,
                              cache_position=torch.tensor([s]), use_cache=True)
                got = step(encoder_outputs=encoded[0], past_key_values=caches[0], **kwargs).logits
                want = twin(encoder_outputs=encoded[1], past_key_values=caches[1], **kwargs).logits
                _close(got, want)
                _close(caches[0], caches[1])
                kept.append((got, want.clone()))
                for old, old_want in kept:
                    _close(old, old_want)
                tok = want[:, -1:].argmax(-1)
    assert _count("captured_") >= 2


def _llama() -> Any:
    torch.manual_seed(5)
    config = transformers.LlamaConfig(**{**SMALL, "num_hidden_layers": 2}, eos_token_id=63, bos_token_id=1)
    return transformers.LlamaForCausalLM(config).eval()


def _padded_prompts(seed: int, length: int, left: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 62, (3, length), generator=gen)
    mask = torch.ones(3, length, dtype=torch.long)
    for b in range(1, 3):
        if left:
            mask[b, : b + seed] = 0
        else:
            mask[b, length - b - seed:] = 0
    return ids.masked_fill(mask == 0, 0), mask


GENERATE = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, cache_implementation="static",
                return_dict_in_generate=True)


def test_generate_left_padded_batch_greedy_matches_eager_token_for_token() -> None:
    model = _llama()
    config = compile_config({"frozen_parameter": True})
    for seed in range(3):  # prompts of 3 lengths, each batch left-padded differently
        ids, mask = _padded_prompts(seed, 6 + seed)
        with torch.no_grad():
            want = model.generate(ids, attention_mask=mask, disable_compile=True, output_logits=True, **GENERATE)
            got = model.generate(ids, attention_mask=mask, compile_config=config, output_logits=True, **GENERATE)
        assert torch.equal(got.sequences, want.sequences)
        _close(list(got.logits), list(want.logits))
    assert _count("captured_") >= 1


@pytest.mark.parametrize("family", ["llama", pytest.param("t5", marks=slow)])
def test_beam_search_through_a_compiled_forward_reorders_the_static_cache(family: str) -> None:
    # transformers' beam search calls model.forward and reorders the StaticCache with
    # index_select (new cache tensors each step): the compiled forward sees new mutated-input
    # addresses every step and must recapture, never replay into the old cache.
    model = _t5()[1] if family == "t5" else _llama()
    eager_forward = model.forward
    compiled_forward = torch.compile(model.forward, backend="npugraph_ex", dynamic=None)
    for seed in range(2):
        ids, mask = _padded_prompts(seed, 6, left=family != "t5")
        kwargs = dict(attention_mask=mask, disable_compile=True, num_beams=3, num_return_sequences=2,
                      output_scores=True, **GENERATE)
        with torch.no_grad():
            model.forward = eager_forward
            want = model.generate(ids, **kwargs)
            model.forward = compiled_forward
            got = model.generate(ids, **kwargs)
        model.forward = eager_forward
        assert torch.equal(got.sequences, want.sequences)
        _close([s.clamp(min=-1e4) for s in got.scores], [s.clamp(min=-1e4) for s in want.scores])
    assert _count("captured_") >= 2
    assert _count("recapture_due_to_mutated_input_change") >= 1


@slow
def test_encoder_and_moe_share_one_graph_pool_interleaved() -> None:
    pool = npugraph_ex.graph_pool_handle("cpu")
    torch.manual_seed(6)
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=48, num_labels=3)).eval()
    config, cls = _moe("qwen2_moe")
    moe = cls(config).eval()
    twins = (copy.deepcopy(bert), copy.deepcopy(moe))
    compiled = tuple(torch.compile(m, backend="npugraph_ex", options={"use_graph_pool": pool})
                     for m in (bert, moe))

    def make(i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        mask = torch.ones(2, 6, dtype=torch.long)
        mask[1, 5 - i % 3:] = 0
        return i % 2, torch.randint(1, 64, (2, 6)), mask

    def call(ms: tuple[Any, Any]) -> Callable[..., Any]:
        def run(k: int, ids: torch.Tensor, mask: torch.Tensor) -> Any:
            kwargs = {} if k == 0 else {"use_cache": False}
            return ms[k](input_ids=ids, attention_mask=mask, **kwargs).logits
        return run

    _compare(make, call(twins), call(compiled), calls=8)
    assert _count("captured_") >= 2


def test_requests_with_fresh_lazy_caches_prefill_and_decode_through_one_compiled_forward() -> None:
    # transformers 4.57 allocates a StaticCache's tensors at its first update, so the first
    # compiled call of each request creates that request's cache inside the graph and returns
    # it: a later request's prefill must not be handed a cache an earlier request still uses.
    # Requests start staggered and are served in turn.
    model = _llama()
    twin = copy.deepcopy(model)
    step = torch.compile(model.forward, backend="npugraph_ex")
    config, batch, prompt, steps = model.config, 2, 4, 5
    requests: list[dict[str, Any]] = []
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for it in range(20):
            if it % 3 == 0 and len(requests) < 3:
                requests.append({"caches": [transformers.StaticCache(config=config, max_batch_size=batch,
                                                                     max_cache_len=12) for _ in range(2)],
                                 "tok": torch.randint(2, 62, (batch, prompt)), "done": 0})
            live = [r for r in requests if r["done"] < steps]
            if not live:
                break
            req = live[it % len(live)]
            n = req["done"]
            at = torch.arange(prompt) if n == 0 else torch.tensor([prompt + n - 1])
            got = step(input_ids=req["tok"], past_key_values=req["caches"][0], cache_position=at).logits[:, -1:]
            want = twin(input_ids=req["tok"], past_key_values=req["caches"][1], cache_position=at).logits[:, -1:]
            _close(got, want)
            kept.append((got, want.clone()))
            for old, old_want in kept:
                _close(old, old_want)
            req["tok"], req["done"] = want.argmax(-1), n + 1
        for req in requests:
            _close(*req["caches"])
    assert _count("captured_") >= 2
    assert _count("recapture_due_to_mutated_input_change") >= 1
