"""Compiled models in the situations where a replay used to return wrong numbers: outputs kept
across replays of one capture (graph breaks in repeated layers, hidden states, several requests
with their own caches, decode loops), one FX graph serving several module instances, threads,
inputs read through as_strided, dtypes. Every result is compared with eager over >= 5 calls."""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from npugraph_backend import EagerFallbackWarning
from torch import nn

transformers = pytest.importorskip("transformers")


def _compile(fn: Any, **options: Any) -> Any:
    return torch.compile(fn, backend="npugraph_ex", dynamic=False, options=options or None)


class BrokenLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h) + x


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BrokenLayer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for layer in self.layers:
            x = layer(x)
            outs.append(x)
        return outs


@torch.no_grad()
def test_graph_break_in_repeated_layers_keeps_every_layer_output(
        counter: Callable[[str], int]) -> None:
    model = Stack().eval()
    f = _compile(model)
    for _ in range(6):
        x = torch.randn(2, 16)
        for got, want in zip(f(x), model(x), strict=True):
            torch.testing.assert_close(got, want)
    assert counter("capture_due_to_new_key_") >= 2
    assert counter("capture_due_to_held_outputs_") >= 1


def _moe(kind: str) -> Any:
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    if kind == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        return transformers.MixtralForCausalLM(config).eval()
    config = transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=16,
                                         shared_expert_intermediate_size=16, **common)
    return transformers.Qwen2MoeForCausalLM(config).eval()


@pytest.mark.parametrize(("kind", "frozen"), [("mixtral", False), ("mixtral", True),
                                           ("qwen2_moe", False)])
@torch.no_grad()
def test_moe_hidden_states_match_eager(kind: str, frozen: bool,
                                       counter: Callable[[str], int]) -> None:
    model = _moe(kind)

    def forward(ids: torch.Tensor) -> Any:
        return model(input_ids=ids, output_hidden_states=True, use_cache=False)

    # frozen_parameter: every expert is an instance of one class, one FX graph for all of them
    f = _compile(forward, frozen_parameter=frozen)
    for _ in range(5):
        ids = torch.randint(0, 64, (1, 6))
        got, want = f(ids), forward(ids)
        torch.testing.assert_close(got.logits, want.logits)
        for g, w in zip(got.hidden_states, want.hidden_states, strict=True):
            torch.testing.assert_close(g, w)
    assert counter("capture_due_to_new_key_") >= 1
    assert counter("eager_fallback_due_to_capture_limit_") == 0


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


def _llama() -> Any:
    return transformers.LlamaForCausalLM(_config(transformers.LlamaConfig)).eval()


@torch.no_grad()
def test_round_robin_requests_with_their_own_dynamic_caches(counter: Callable[[str], int]) -> None:
    model = _llama()

    def step(ids: torch.Tensor, cache: Any) -> Any:
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        return out.logits

    f = _compile(step)
    prompts = [torch.randint(0, 128, (1, 4)) for _ in range(3)]
    caches = [transformers.DynamicCache() for _ in prompts]
    eager_caches = [transformers.DynamicCache() for _ in prompts]
    tokens = [p for p in prompts]
    for _ in range(5):
        for r in range(len(prompts)):  # one step of each request in turn
            got = f(tokens[r], caches[r])
            want = step(tokens[r], eager_caches[r])
            torch.testing.assert_close(got, want)
            tokens[r] = want[:, -1:].argmax(-1)
    assert counter("capture_due_to_") >= 1


@torch.no_grad()
def test_decode_loop_alternates_two_captures_without_recapture(
        counter: Callable[[str], int]) -> None:
    model = _llama()
    f = _compile(lambda ids: model(input_ids=ids, use_cache=False))
    tok = ref = torch.randint(0, 128, (1, 1))
    for _ in range(10):
        logits = f(tok).logits  # the previous logits are still referenced during the call
        tok = logits[:, -1:].argmax(-1)
        expected = model(input_ids=ref, use_cache=False).logits
        torch.testing.assert_close(logits, expected)
        ref = expected[:, -1:].argmax(-1)
    assert counter("capture_due_to_new_key_") == 1
    assert counter("capture_due_to_held_outputs_") == 1
    assert counter("recapture_due_to_") == 0


@pytest.mark.parametrize("frozen", [False, True])
@torch.no_grad()
def test_two_instances_of_one_class_alternate_without_recapture(
        frozen: bool, counter: Callable[[str], int]) -> None:
    m1, m2 = (nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval() for _ in range(2))
    f1, f2 = _compile(m1, frozen_parameter=frozen), _compile(m2, frozen_parameter=frozen)
    for _ in range(6):
        for f, m in ((f1, m1), (f2, m2)):
            x = torch.randn(2, 8)
            torch.testing.assert_close(f(x), m(x))
    captures = counter("capture_due_to_new_key_") + counter("recapture_due_to_")
    assert 1 <= captures <= 2  # one capture per instance, however often they alternate


@pytest.mark.parametrize("clone_output", [False, True])
def test_threads_hammering_one_compiled_model(clone_output: bool) -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).eval()
    f = _compile(model, clone_output=clone_output)
    with torch.no_grad():
        f(torch.randn(4, 16))
        f(torch.randn(4, 16))

    def one_call(_: int) -> bool:
        with torch.no_grad():
            x = torch.randn(4, 16)
            return torch.allclose(f(x), model(x), atol=1e-5, rtol=1e-4)

    with ThreadPoolExecutor(4) as pool:  # errors of a call are raised here
        results = list(pool.map(one_call, range(400)))
    assert all(results)


@torch.no_grad()
def test_as_strided_reads_of_view_inputs_match_eager() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.as_strided(x, (3,), (1,), 2) * 2

    f = _compile(fn)
    for _ in range(6):
        x = torch.randn(6)[1:]
        torch.testing.assert_close(f(x), fn(x))


@torch.no_grad()
def test_each_dtype_gets_its_own_graph() -> None:
    f = _compile(lambda x: x * 3 + 1)
    for dtype in (torch.float32, torch.float64, torch.complex64) * 2:
        x = torch.randn(4, dtype=dtype)
        out = f(x)
        assert out.dtype == dtype
        torch.testing.assert_close(out, x * 3 + 1)


def test_grad_mode_warning_points_at_the_users_call() -> None:
    model = copy.deepcopy(nn.Linear(4, 4))
    f = _compile(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(torch.randn(2, 4))  # grad mode on, parameters require grad: runs eagerly
    ours = [w for w in caught if issubclass(w.category, EagerFallbackWarning)]
    assert ours and ours[0].filename == __file__


@torch.no_grad()
def test_llama_decode_with_a_static_cache_runs_each_first_call_once(
        counter: Callable[[str], int], monkeypatch: pytest.MonkeyPatch) -> None:
    # counts the runs of each captured graph (the real graph runs): on the CPU a new key's
    # capture is its call's run, so each capture runs its graph once and writes the cache once
    import npugraph_runtime

    runs: list[int] = []
    init = npugraph_runtime.GraphedCallable.__init__

    def counting(self: Any, fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        def counted(*a: object) -> object:
            runs.append(1)
            return fn(*a)

        init(self, counted, *args, **kwargs)

    monkeypatch.setattr(npugraph_runtime.GraphedCallable, "__init__", counting)
    model = _llama()

    def step(ids: torch.Tensor, pos: torch.Tensor, cache: Any) -> Any:
        return model(input_ids=ids, cache_position=pos, past_key_values=cache, use_cache=True).logits

    f = _compile(step)
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    eager_cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    prompt = torch.randint(0, 128, (1, 4))
    torch.testing.assert_close(f(prompt, torch.arange(4), cache), step(prompt, torch.arange(4), eager_cache))
    tok = torch.randint(0, 128, (1, 1))
    for i in range(4, 10):
        pos = torch.tensor([i])
        want = step(tok, pos, eager_cache)
        torch.testing.assert_close(f(tok, pos, cache), want)
        for got_layer, want_layer in zip(cache.layers, eager_cache.layers, strict=True):
            torch.testing.assert_close(got_layer.keys, want_layer.keys)
            torch.testing.assert_close(got_layer.values, want_layer.values)
        tok = want[:, -1:].argmax(-1)
    captures = counter("capture_due_to_")
    assert captures >= 2  # the prompt's graph and the decode step's
    assert len(runs) == captures


SHARED_NORM = nn.LayerNorm(16)


class SharedFirst(nn.Module):
    """Instances share the submodule their forward uses first."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = SHARED_NORM
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.proj(self.norm(x)))


class ClassTensorFirst(nn.Module):
    """Instances read a class-attribute tensor first (a static input they all share)."""

    table = torch.rand(16) + 0.5

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.table + torch.relu(self.proj(x))


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("cls", [SharedFirst, ClassTensorFirst])
def test_instances_sharing_their_first_static_input_replay_their_own_weights(
        replays_match_eager: Callable[..., None], cls: type[nn.Module], frozen: bool, counter: Callable[[str], int]) -> None:
    # frozen_parameter once checked only the first static input, which these instances share:
    # every layer replayed the first layer's capture
    layers = [cls().eval() for _ in range(3)]
    block = _compile(cls.forward, frozen_parameter=frozen)

    def run(f: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor], list[torch.Tensor]]:
        return lambda x: [f(layer, x) for layer in layers]

    replays_match_eager(run(cls.forward), run(block), lambda i: (torch.randn(4, 16),))
    assert counter("capture_due_to_new_key_") == 1
    assert counter("recapture_due_to_static_input_change_") >= 2


class BreakingLayer(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.how = how

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        if self.how == "item":
            h = h * (1.0 if h.sum().item() > 0 else -1.0)
        elif self.how == "branch":
            h = h * 2 if h.mean() > 0.2 else h - 1
        else:
            print(end="")
        return self.b(h) + x, h


class BreakingStack(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BreakingLayer(how) for _ in range(3))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for layer in self.layers:
            x, h = layer(x)
            outs += [x, h]
        return outs


@pytest.mark.parametrize(("how", "options"), [
    ("print", {}), ("item", {"frozen_parameter": True}), ("branch", {"clone_output": True}),
    ("print", {"clone_input": False}), ("item", {"clone_input": False}),
])
def test_graph_broken_layers_keep_every_output(replays_match_eager: Callable[..., None], how: str, options: dict[str, Any],
                                               counter: Callable[[str], int]) -> None:
    # each layer's graphs feed the next ones; every layer's results are kept. Under
    # clone_input=False the second graph once adopted the first graph's result as its input
    # buffer, and the next call's refill overwrote the kept result
    model = BreakingStack(how).eval()
    replays_match_eager(model, _compile(model, **options), lambda i: (torch.randn(4, 16),))
    assert counter("capture_due_to_new_key_") >= 2


@pytest.mark.parametrize("clone_output", [False, True])
def test_instances_with_a_graph_break_keep_outputs_under_clone_input_false(
        replays_match_eager: Callable[..., None], clone_output: bool, counter: Callable[[str], int]) -> None:
    # the second instance's capture of the graph after the break adopted that call's input (the
    # first graph's result, a clone under clone_output) as its buffer: the next call's refill
    # overwrote a result the caller kept
    layers = [BreakingLayer("print").eval() for _ in range(3)]
    layer_forward = _compile(BreakingLayer.forward, clone_input=False, clone_output=clone_output)

    def run(f: Callable[..., tuple[torch.Tensor, torch.Tensor]]
            ) -> Callable[[torch.Tensor], list[torch.Tensor]]:
        return lambda x: [t for layer in layers for t in f(layer, x)]

    replays_match_eager(run(BreakingLayer.forward), run(layer_forward),
                        lambda i: (torch.randn(4, 16),))
    assert counter("recapture_due_to_static_input_change_") >= 2


def test_threads_keep_their_outputs(replays_match_eager: Callable[..., None], counter: Callable[[str], int]) -> None:
    model = BreakingStack("print").eval()
    compiled = _compile(model)
    with torch.no_grad():  # grad mode is per thread: the fixture's no_grad holds in the workers only
        compiled(torch.randn(4, 16))
    failures: list[BaseException] = []

    def work(seed: int) -> None:
        torch.manual_seed(seed)
        try:
            replays_match_eager(model, compiled, lambda i: (torch.randn(4, 16),))
        except BaseException as e:  # reported by the main thread
            failures.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[0]
    assert counter("capture_due_to_new_key_") >= 2


@torch.no_grad()
def test_round_robin_requests_with_their_own_static_caches(counter: Callable[[str], int]) -> None:
    model = _llama()
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
    model, sources = _llama(), [_llama().state_dict() for _ in range(3)]
    step = torch.compile(model, backend="npugraph_ex", options={"frozen_parameter": frozen})
    for i in range(6):
        if i >= 1:  # same parameter addresses, new values: a replay must read them
            model.load_state_dict(sources[i % 3])
        ids = torch.randint(0, VOCAB, (2, 7))
        torch.testing.assert_close(step(input_ids=ids, use_cache=False).logits,
                                   model(input_ids=ids, use_cache=False).logits)
