"""capture_sizes / pad_values: a call of a size not captured is padded to the next capture size,
replayed and sliced back, where the FX graph shows padding cannot change a real row; otherwise
the compile is refused with the op, the input and the user's source line."""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Callable

import pytest
import torch
from npugraph_backend import _compat
from npugraph_backend.config import (
    AUTO_CAPTURE_SIZES,
    CompilerConfig,
    OptionError,
    resolved_capture_sizes,
)
from npugraph_backend.padding_analysis import PaddingRefused
from torch import nn

SCRATCH = 63
SIZES = [2, 4, 8, 16]


class Decoder(nn.Module):
    """Two layers over one stacked KV cache per K and V (slots x positions), written at
    (slot, position) per request and read through the request's slot under a position mask."""

    def __init__(self, layers: int = 2, hidden: int = 32, vocab: int = 50, slots: int = 64,
                 positions: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.qkv = nn.ModuleList(nn.Linear(hidden, 3 * hidden) for _ in range(layers))
        self.out = nn.Linear(hidden, vocab)
        self.register_buffer("kc", torch.zeros(layers, slots, positions, hidden))
        self.register_buffer("vc", torch.zeros(layers, slots, positions, hidden))

    def forward(self, tokens: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        mask = torch.arange(self.kc.shape[2])[None, :] <= pos[:, None]
        for layer, proj in enumerate(self.qkv):
            q, k, v = proj(x).chunk(3, -1)
            self.kc[layer].index_put_((slots, pos), k)
            self.vc[layer].index_put_((slots, pos), v)
            keys, values = self.kc[layer][slots], self.vc[layer][slots]
            scores = (q[:, None, :] * keys).sum(-1).masked_fill(~mask, float("-inf"))
            x = x + (scores.softmax(-1)[:, :, None] * values).sum(1)
        return self.out(x)


def _compiled(model: nn.Module, **options: object) -> Callable[..., torch.Tensor]:
    return torch.compile(model, backend="npugraph_ex", dynamic=True, options=options)


def _batch(size: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    tokens = torch.randint(0, 50, (size,), generator=gen)
    slots = torch.randperm(SCRATCH, generator=gen)[:size]  # distinct real slots, never the scratch
    pos = torch.randint(0, 16, (size,), generator=gen)
    return tokens, slots, pos


def _refusal(excinfo: pytest.ExceptionInfo[BaseException]) -> BaseException:
    """The backend's own error under Dynamo's BackendCompilerFailed."""
    err: BaseException | None = excinfo.value
    while err is not None and not isinstance(err, PaddingRefused | OptionError):
        err = getattr(err, "inner_exception", None) or err.__cause__
    assert err is not None, f"not a padding refusal: {excinfo.value!r}"
    return err


def _decode(compiled: Callable[..., torch.Tensor], eager: Decoder, model: Decoder,
            sizes: list[int]) -> None:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for size in sizes:
            args = _batch(size, gen)
            out = compiled(*args)
            expected = eager(*args)
            assert out.shape == expected.shape
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
            # padded rows wrote only the scratch slot: every other slot equals eager's
            for mine, theirs in ((model.kc, eager.kc), (model.vc, eager.vc)):
                torch.testing.assert_close(mine[:, :SCRATCH], theirs[:, :SCRATCH],
                                           rtol=1e-5, atol=1e-5)


CALLS = [3, 5, 7, 2, 3, 9, 11, 6, 5, 3, 12, 15, 4, 10, 7, 13, 2, 14, 6, 9]


def test_padded_decode_equals_eager_with_bounded_captures(counter: Callable[[str], int]) -> None:
    model = Decoder()
    eager = copy.deepcopy(model)
    compiled = _compiled(model, capture_sizes=SIZES, pad_values={"slots": SCRATCH})
    _decode(compiled, eager, model, CALLS)
    used = {next(s for s in SIZES if s >= n) for n in CALLS}
    assert used == set(SIZES)
    assert counter("captured_") >= len(used)  # it was captured, not run eagerly
    assert counter("capture_due_to_new_key") == len(used)  # one key per capture size
    assert counter("captured_") <= 2 * len(used)
    assert counter("fallback") == 0
    # the scratch slot took the padded rows' writes (the proof that rows were padded)
    assert model.kc[:, SCRATCH].abs().sum() > 0
    assert eager.kc[:, SCRATCH].abs().sum() == 0


def test_logits_kept_across_the_next_call_cost_no_second_capture(
        counter: Callable[[str], int]) -> None:
    """A server keeps each step's logits while it runs the next step: they keep their values,
    and no size is captured twice for it (no held-output capture)."""
    model = Decoder()
    eager = copy.deepcopy(model)
    compiled = _compiled(model, capture_sizes=SIZES, pad_values={"slots": SCRATCH})
    gen = torch.Generator().manual_seed(2)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for size in CALLS:
            args = _batch(size, gen)
            out = compiled(*args)
            kept.append((out, out.clone()))
            torch.testing.assert_close(out, eager(*args), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(out, was) for out, was in kept)  # no later replay wrote them
    used = {next(s for s in SIZES if s >= n) for n in CALLS}
    assert counter("captured_") == len(used)
    assert counter("capture_due_to_held_outputs") == 0
    assert counter("fallback") == 0


def test_padding_off_captures_per_size(counter: Callable[[str], int]) -> None:
    model = Decoder()
    eager = copy.deepcopy(model)
    _decode(_compiled(model), eager, model, CALLS)
    assert counter("capture_due_to_new_key") == len(set(CALLS))
    assert model.kc[:, SCRATCH].abs().sum() == 0


def test_sizes_above_the_largest_run_unpadded(counter: Callable[[str], int]) -> None:
    model = Decoder()
    eager = copy.deepcopy(model)
    compiled = _compiled(model, capture_sizes=[2, 4], pad_values={"slots": SCRATCH})
    _decode(compiled, eager, model, [3, 6, 9, 6, 3])
    # 4 (the call's), 2 ahead of any call of it, then 6 and 9 as themselves
    assert counter("capture_due_to_new_key") == 4
    assert counter("capture_ahead") == 1


def test_auto_ladder(counter: Callable[[str], int]) -> None:
    assert resolved_capture_sizes(CompilerConfig(capture_sizes="auto")) == AUTO_CAPTURE_SIZES
    model = Decoder()
    eager = copy.deepcopy(model)
    compiled = _compiled(model, capture_sizes="auto", pad_values={"slots": SCRATCH})
    _decode(compiled, eager, model, [5, 7, 6, 9, 11])
    assert counter("capture_due_to_new_key") == 2  # 8 and 12: the ladder is captured lazily
    assert counter("capture_ahead") == 0


def test_mutated_input_with_the_padded_dim_gets_its_real_rows_back(
    counter: Callable[[str], int],
) -> None:
    def step(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        state.mul_(0.5).add_(x)
        return state.sum(-1) * 2

    compiled = _compiled(step, capture_sizes=[4, 8])
    for size in (3, 5, 6, 3):
        state, x = torch.randn(size, 8), torch.randn(size, 8)
        mine = state.clone()
        out = compiled(mine, x)
        expected = step(state, x)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(mine, state)
    assert counter("capture_due_to_new_key") == 2


def test_refuses_a_reduction_over_the_batch() -> None:
    def mean_over_batch(x: torch.Tensor) -> torch.Tensor:
        return x - x.sum(0)

    with pytest.raises(Exception) as excinfo:
        _compiled(mean_over_batch, capture_sizes=SIZES)(torch.randn(3, 4))
    message = str(_refusal(excinfo))
    assert "aten.sum" in message and "dim 0" in message
    assert "test_capture_sizes.py" in message and "x - x.sum(0)" in message


def test_refuses_a_softmax_over_the_batch() -> None:
    def weights(x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x * 2, dim=0)

    with pytest.raises(Exception) as excinfo:
        _compiled(weights, capture_sizes=SIZES)(torch.randn(3, 4))
    message = str(_refusal(excinfo))
    assert "softmax" in message and "torch.softmax(x * 2, dim=0)" in message


def test_refuses_a_write_indexed_by_a_padded_input_without_a_pad_value() -> None:
    model = Decoder()
    with pytest.raises(Exception) as excinfo, torch.no_grad():
        _compiled(model, capture_sizes=SIZES)(*_batch(3, torch.Generator().manual_seed(0)))
    message = str(_refusal(excinfo))
    assert "aten.index_put" in message and "input 'slots'" in message
    assert "L['self']._buffers['kc']" in message
    assert "pad_values={'slots': <scratch row>}" in message
    assert "self.kc[layer].index_put_((slots, pos), k)" in message


def test_refuses_the_size_used_as_a_value() -> None:
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * x.shape[0]

    with pytest.raises(Exception) as excinfo:
        _compiled(scaled, capture_sizes=SIZES)(torch.randn(3, 4))
    assert "uses the padded size as a value" in str(_refusal(excinfo))


def test_needs_dynamic_shapes() -> None:
    fn = torch.compile(lambda x: x + 1, backend="npugraph_ex", dynamic=False,
                       options={"capture_sizes": SIZES})
    with pytest.raises(Exception) as excinfo:
        fn(torch.randn(3, 4))
    message = str(_refusal(excinfo))
    assert "'capture_sizes'" in message and "dynamic=True" in message


def test_pad_values_keys_are_forward_arguments() -> None:
    model = Decoder()
    with pytest.raises(Exception) as excinfo, torch.no_grad():
        _compiled(model, capture_sizes=SIZES, pad_values={"slot": SCRATCH})(
            *_batch(3, torch.Generator().manual_seed(0)))
    message = str(_refusal(excinfo))
    assert "'slot'" in message and "pos, slots, tokens" in message


def test_pad_values_need_capture_sizes() -> None:
    with pytest.raises(Exception) as excinfo:
        _compiled(lambda x: x + 1, pad_values={"x": 0})(torch.randn(3, 4))
    assert "needs capture_sizes" in str(_refusal(excinfo)) or "without capture_sizes" in str(
        _refusal(excinfo))


@pytest.mark.parametrize("value", [[4, 2], [0, 2], [2, 2], [], [True, 2], "all", 8, [2.0]])
def test_capture_sizes_validation(value: object) -> None:
    with pytest.raises(OptionError, match=r"option 'capture_sizes': value .* allowed: None, 'auto'"):
        CompilerConfig(capture_sizes=value)


@pytest.mark.parametrize("value", [[("slots", 63)], {"slots": "63"}, {1: 63}, {"slots": float("nan")}])
def test_pad_values_validation(value: object) -> None:
    with pytest.raises(OptionError, match=r"option 'pad_values': value .* allowed: None or a dict"):
        CompilerConfig(pad_values=value)


def test_options_round_trip() -> None:
    config = CompilerConfig(capture_sizes=[1, 8], pad_values={"slots": 63})
    assert config.capture_sizes == (1, 8)
    rebuilt = CompilerConfig.from_options(config.as_dict())
    assert rebuilt == config and rebuilt.hash() == config.hash()
    assert _compat.counters() is not None


def test_reshape_keeps_rows_apart_only_with_the_batch_outermost(
    counter: Callable[[str], int],
) -> None:
    def heads(x: torch.Tensor) -> torch.Tensor:
        # [B, 4 * 8] -> [B, 4, 8] -> [B * 4, 8]: each row stays a block of its own
        y = x.view(x.shape[0], 4, 8).softmax(-1).reshape(-1, 8)
        return y.view(x.shape[0], 32) * 2

    compiled = _compiled(heads, capture_sizes=[4, 8])
    for size in (3, 5, 7):
        x = torch.randn(size, 32)
        torch.testing.assert_close(compiled(x), heads(x))
    assert counter("capture_due_to_new_key") == 2

    def interleaved(x: torch.Tensor) -> torch.Tensor:
        return x.t().reshape(-1)[:4] * 1.0  # [32, B] -> [32 * B]: rows interleave

    with pytest.raises(Exception) as excinfo:
        _compiled(interleaved, capture_sizes=[4, 8])(torch.randn(3, 32))
    message = str(_refusal(excinfo))
    assert "aten._unsafe_view" in message and "mixes the padded rows with real ones" in message
    assert "x.t().reshape(-1)[:4]" in message


@pytest.mark.parametrize(("pad", "says"), [
    (64, "is not a row of dim 0"),  # the cache has 64 slots: 0..63
    (6.5, "that input is torch.int64"),
])
def test_refuses_a_pad_value_that_is_no_row(pad: object, says: str) -> None:
    model = Decoder()
    with pytest.raises(Exception) as excinfo, torch.no_grad():
        _compiled(model, capture_sizes=SIZES, pad_values={"slots": pad})(
            *_batch(3, torch.Generator().manual_seed(0)))
    assert says in str(_refusal(excinfo))


def test_threads_pad_into_buffers_of_their_own(counter: Callable[[str], int]) -> None:
    import threading

    weight = torch.randn(32, 32)

    def mlp(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight) * 2

    compiled = _compiled(mlp, capture_sizes=[8, 16])
    compiled(torch.randn(5, 32))  # compiled once, before the threads race
    failures: list[str] = []

    def worker(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(15):
            x = torch.randn(int(torch.randint(2, 16, (1,), generator=gen)), 32, generator=gen)
            out = compiled(x)
            if not torch.allclose(out, mlp(x), rtol=1e-5, atol=1e-5):
                failures.append(f"thread {seed}, {x.shape[0]} rows")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert counter("captured_") > 0


def test_refuses_a_matmul_contracting_the_batch() -> None:
    def gram(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.t() @ y  # [H, B] @ [B, H]: sums over the batch

    with pytest.raises(Exception) as excinfo:
        _compiled(gram, capture_sizes=SIZES)(torch.randn(3, 4), torch.randn(3, 4))
    message = str(_refusal(excinfo))
    assert "aten.mm" in message and "contracts dim" in message and "x.t() @ y" in message


def test_cache_compile_pads_cold_and_warm(tmp_path: object, counter: Callable[[str], int]) -> None:
    """cache_compile's aot_compile drops Dynamo's input sources: pad_values still finds
    'slots', and the padding plan is saved with the graph and used by a warm start."""
    inference = pytest.importorskip("npugraph_ex.inference")
    options = {"capture_sizes": [4, 8, 16], "pad_values": {"slots": SCRATCH}}
    for start in ("cold", "warm"):
        _compat.dynamo_reset()
        model = Decoder()
        eager = copy.deepcopy(model)
        compiled = inference.cache_compile(model.forward, cache_dir=str(tmp_path),
                                           options=options)
        before = counter("capture_due_to_new_key")
        _decode(compiled, eager, model, [3, 5, 6, 7, 9])
        assert counter("capture_due_to_new_key") - before == 3, start  # 4, 8 and 16
        assert model.kc[:, SCRATCH].abs().sum() > 0, start


class CountingDecoder(nn.Module):
    """A decode step whose state updates are not idempotent: a step counter, and KV rows
    accumulated into (a second run of the step would show in both)."""

    def __init__(self, hidden: int = 16, slots: int = 64, positions: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.register_buffer("step", torch.zeros(()))
        self.register_buffer("kc", torch.zeros(slots, positions, hidden))

    def forward(self, tokens: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.step += 1
        k = self.proj(self.emb(tokens))
        self.kc.index_put_((slots, pos), k, accumulate=True)
        return k * self.step + self.kc[slots].sum(1)


def _captured_sizes(records: list[logging.LogRecord]) -> list[int]:
    """The batch of each capture, in the order they were made (from the runtime's log line)."""
    return [int(re.search(r"graph key \((\d+),", r.getMessage()).group(1))  # type: ignore[union-attr]
            for r in records if "captured graph key" in r.getMessage()]


def test_declared_sizes_are_captured_largest_first_without_changing_state(
        counter: Callable[[str], int], caplog: pytest.LogCaptureFixture) -> None:
    """The first padded call captures every declared size, largest first (one pool holds them
    all: each smaller capture reuses what the larger ones freed); the sizes it does not need
    are captured ahead with no effect, so the model's state ends as eager's after that call,
    and every later call of any size replays."""
    model = CountingDecoder()
    eager = copy.deepcopy(model)
    compiled = _compiled(model, capture_sizes=[2, 4, 8, 16], pad_values={"slots": SCRATCH})
    gen = torch.Generator().manual_seed(3)
    caplog.set_level(logging.INFO, logger="npugraph_ex")
    with torch.no_grad():
        for n, size in enumerate([5, 3, 16, 2, 9, 8, 7, 4, 12, 6]):
            args = _batch(size, gen)
            out = compiled(*args)
            torch.testing.assert_close(out, eager(*args), rtol=1e-5, atol=1e-5)
            assert torch.equal(model.step, eager.step)  # each call stepped it once
            torch.testing.assert_close(model.kc[:SCRATCH], eager.kc[:SCRATCH],
                                       rtol=1e-5, atol=1e-5)
            if n == 0:
                assert _captured_sizes(caplog.records) == [16, 8, 4, 2]
                made = counter("captured_")
    assert made == 4 and counter("captured_") == 4  # nothing captured after the first call
    assert counter("capture_ahead") == 3 and counter("capture_due_to_new_key") == 4
    assert counter("fallback") == 0
    assert model.kc[SCRATCH].abs().sum() > 0  # rows were padded (into the scratch slot)
