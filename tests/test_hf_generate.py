"""transformers' generate compiled by npugraph_ex, through ``npugraph_ex.hf.compile_config``
(transformers' own compiled loop: greedy and sampling) and ``npugraph_ex.hf.generate`` (every
mode, beam search included): a capture really happens on the CPU (counters), and the tokens equal
eager's for several prompts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import npugraph_ex  # noqa: E402
from npugraph_ex.hf import compile_config  # noqa: E402

NEW_TOKENS = 8  # 7 decode steps through the compiled forward: 1 capture, then replays
PROMPTS = 3


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    from torch._dynamo.utils import counters

    torch.compiler.reset()
    counters.clear()
    yield
    torch.compiler.reset()
    counters.clear()


def _model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _prompt(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(seed))


def _generate(model: Any, prompt: torch.Tensor, *, ours: bool = False, **kwargs: Any) -> list[int]:
    """The new tokens of ``model.generate`` (``npugraph_ex.hf.generate`` when ours)."""
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                  cache_implementation="static", **kwargs)
    with torch.no_grad():
        out = npugraph_ex.hf.generate(model, prompt, **kwargs) if ours else model.generate(
            prompt, **kwargs)
    return [int(t) for t in out[0, prompt.shape[1]:]]


def _captures() -> int:
    from torch._dynamo.utils import counters

    return sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured_"))


def test_generate_with_compile_config_captures_on_cpu_and_matches_eager() -> None:
    model = _model()
    config = compile_config()
    for seed in range(PROMPTS):  # fresh prompts: the later ones replay the same capture
        prompt = _prompt(seed)
        eager = _generate(model, prompt, disable_compile=True)
        assert _generate(model, prompt, compile_config=config) == eager
    assert _captures() >= 1
    assert config.backend in ("npugraph_ex", npugraph_ex.hf._backend())


def test_plain_compile_config_is_not_compiled_on_cpu() -> None:
    # Why the helper exists: transformers skips compilation off CUDA without its private flag.
    model = _model()
    plain = transformers.CompileConfig(backend="npugraph_ex", fullgraph=True, mode=None)
    _generate(model, _prompt(0), compile_config=plain)
    assert _captures() == 0


def test_options_are_passed_and_validated_up_front() -> None:
    with pytest.raises(npugraph_ex.OptionError, match="capture_limit"):
        compile_config({"capture_limit": 0})
    model = _model()
    config = compile_config({"force_eager": True})
    prompt = _prompt(1)
    assert _generate(model, prompt, compile_config=config) == _generate(
        model, prompt, disable_compile=True)
    from torch._dynamo.utils import counters

    assert _captures() == 0
    assert any(k.startswith("eager_fallback_due_to_force_eager") for k in counters["npugraph_ex"])


def test_beam_search_runs_the_captured_step_and_matches_eager() -> None:
    # transformers 4.57's _beam_search calls the plain forward: compile_config alone captures
    # nothing there; hf.generate compiles the forward itself. Beam search re-binds the static
    # cache's tensors every step (index_select): the runtime copies them in and out.
    model = _model()
    for seed in range(PROMPTS):
        prompt = _prompt(seed)
        eager = _generate(model, prompt, num_beams=3, disable_compile=True)
        assert _generate(model, prompt, ours=True, num_beams=3) == eager
    assert _captures() >= 1
    assert "forward" not in vars(model)  # the model's own forward is back after each call


def test_compile_config_alone_is_unused_by_beam_search() -> None:
    # Why hf.generate exists: the same call with transformers' compile_config captures nothing.
    model = _model()
    _generate(model, _prompt(0), num_beams=3, compile_config=compile_config())
    assert _captures() == 0


def test_hf_generate_greedy_matches_eager_and_reuses_its_compiled_forward() -> None:
    model = _model()
    for seed in range(PROMPTS):
        prompt = _prompt(seed)
        assert _generate(model, prompt, ours=True) == _generate(model, prompt,
                                                                disable_compile=True)
    assert _captures() == 1  # one decode step shape: one capture, replayed by every prompt


def test_hf_generate_refuses_transformers_own_compile_arguments() -> None:
    model = _model()
    with pytest.raises(ValueError, match="compile_config"):
        _generate(model, _prompt(0), ours=True, compile_config=compile_config())
    with pytest.raises(npugraph_ex.OptionError, match="capture_limit"):
        _generate(model, _prompt(0), ours=True, options={"capture_limit": 0})


def test_hf_generate_warns_that_a_dynamic_cache_is_never_replayed() -> None:
    model = _model()
    prompt = _prompt(0)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="cache_implementation=None"):
        ours = npugraph_ex.hf.generate(model, prompt, max_new_tokens=2, do_sample=False)
        eager = model.generate(prompt, max_new_tokens=2, do_sample=False, disable_compile=True)
    assert torch.equal(ours, eager)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_generate_with_compile_config_captures_on_cuda_and_matches_eager() -> None:
    model = _model().cuda()
    config = compile_config()
    for seed in range(PROMPTS):
        prompt = _prompt(seed).cuda()
        assert _generate(model, prompt, compile_config=config) == _generate(
            model, prompt, disable_compile=True)
    assert _captures() >= 1
