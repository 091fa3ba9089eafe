"""One capture's static output kept by another capture as its input: graph B updating graph A's
result in place (what a graph break inside a layer makes of ``res.add_(...)`` in its second
half). B's capture keeps an alias of A's output; A must not read that as the caller holding its
output, or every call makes a capture of A and then of B (there was one per call before). What
the caller itself keeps must still be seen."""

from __future__ import annotations

import gc

import pytest
import torch
from npugraph_runtime import make_graphed_callable
from torch._dynamo.utils import counters

CALLS = 8


def first_half(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w + 1.0


def second_half(res: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    res.add_(torch.tanh(res @ w))  # in place on the other graph's result
    return res * 2.0


@pytest.fixture
def weights() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(8, 8) * 0.3, torch.randn(8, 8) * 0.3


def _pair(weights: tuple[torch.Tensor, torch.Tensor], **policy: object) -> tuple[object, object]:
    w1, w2 = weights
    x = torch.randn(4, 8)
    a = make_graphed_callable(first_half, (x, w1), static_argnums=(1,), **policy)
    b = make_graphed_callable(second_half, (first_half(x, w1), w2), static_argnums=(1,),
                              mutated_argnums=(0,), **policy)
    return a, b


def _eager(x: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    res = first_half(x, weights[0])
    return res, second_half(res, weights[1])


@pytest.mark.parametrize("policy", [{}, {"warmup": 0}, {"clone_input": False}])
def test_a_result_the_next_graph_updates_in_place_replays(
    weights: tuple[torch.Tensor, torch.Tensor], policy: dict[str, object],
) -> None:
    a, b = _pair(weights, **policy)
    for _ in range(CALLS):
        x = torch.randn(4, 8)
        res = a(x, weights[0])
        out = b(res, weights[1])
        want_res, want_out = _eager(x, weights)
        torch.testing.assert_close(res, want_res)
        torch.testing.assert_close(out, want_out)
        del res, out
    # A: its one capture. B: the first call's capture saw the first call's own result (a CPU
    # capture that is the call's run returns a copy), then A's static output, at one address
    assert len(a.events) == 1, [e.reason for e in a.events]
    assert len(b.events) <= 2, [e.reason for e in b.events]


@pytest.mark.parametrize("view", [False, True])
def test_what_the_caller_keeps_of_the_lent_output_is_never_overwritten(
    weights: tuple[torch.Tensor, torch.Tensor], view: bool,
) -> None:
    a, b = _pair(weights, capture_limit=CALLS + 2)
    kept, want = [], []
    for _ in range(CALLS):
        x = torch.randn(4, 8)
        res = a(x, weights[0])
        b(res, weights[1])
        kept.append(res[1:] if view else res)
        want.append(_eager(x, weights)[0][1:] if view else _eager(x, weights)[0])
        del res
        for got, expected in zip(kept, want, strict=True):
            torch.testing.assert_close(got, expected)
    assert sum(e.reason == "held_outputs" for e in a.events) >= 1


def test_a_released_borrower_gives_its_references_back(
    weights: tuple[torch.Tensor, torch.Tensor],
) -> None:
    a, b = _pair(weights)
    for _ in range(3):
        x = torch.randn(4, 8)
        b(a(x, weights[0]), weights[1])
    b.reset()  # drops B's captures and what they kept of A's output
    del b
    gc.collect()
    for _ in range(3):
        x = torch.randn(4, 8)
        torch.testing.assert_close(a(x, weights[0]), first_half(x, weights[0]))
    assert len(a.events) == 1, [e.reason for e in a.events]  # A's counts are exact again
    kept = a(torch.randn(4, 8), weights[0])
    x = torch.randn(4, 8)
    torch.testing.assert_close(a(x, weights[0]), first_half(x, weights[0]))
    assert [e.reason for e in a.events][-1] == "held_outputs"  # and what the caller keeps is seen
    del kept


def test_a_caller_keeping_only_the_storage_of_an_output_keeps_its_values(
    weights: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """``out.untyped_storage()`` hands back the Python storage object the capture already holds,
    so the storage's use count does not move: the output ledger counts that object's references
    too, and a later call replays another capture rather than overwrite what the caller kept."""
    w1 = weights[0]
    a = make_graphed_callable(first_half, (torch.randn(4, 8), w1), static_argnums=(1,),
                              capture_limit=CALLS + 2)
    kept, want = [], []
    for _ in range(CALLS):
        x = torch.randn(4, 8)
        out = a(x, w1)
        torch.testing.assert_close(out, first_half(x, w1))
        kept.append(out.untyped_storage())
        want.append(first_half(x, w1))
        del out
        for storage, expected in zip(kept, want, strict=True):
            got = torch.empty(0).set_(storage, 0, expected.shape, expected.stride())
            torch.testing.assert_close(got, expected)
    # a kept storage made a later call take another capture of the key (a capture's own run
    # returns copies, so not every call's storage is a static output)
    reasons = [e.reason for e in a.events]
    assert "held_outputs" in reasons and len(reasons) <= CALLS, reasons
    kept.clear()
    gc.collect()
    for _ in range(3):  # nothing kept any more: the existing captures replay
        x = torch.randn(4, 8)
        torch.testing.assert_close(a(x, w1), first_half(x, w1))
    assert len(a.events) == len(reasons)


def _logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).view(2, 2, 8)  # (batch, positions, vocab)


def _scale_and_pick(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    logits.div_(t)  # the sampler scales the held logits in place
    return logits.argmax(-1)


def test_a_sampler_scaling_held_logits_in_place_is_not_a_capture_per_call(
    weights: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """The decode graph's logits, held by the caller across the next decode call (so decode
    alternates between two captures), are viewed by the caller (``logits[:, -1]``, a new tensor
    object every call) and scaled in place by a sampler graph. The sampler's captures keep their
    views of the two static outputs: a view object the caller dropped does not free the storage,
    which the decode captures hand out again, so each sampler capture stays and replays."""
    w = weights[0]
    t = torch.tensor(0.7)
    x0 = torch.randn(4, 8)
    decode = make_graphed_callable(_logits, (x0, w), static_argnums=(1,))
    sample = make_graphed_callable(_scale_and_pick, (_logits(x0, w)[:, -1], t),
                                   mutated_argnums=(0,))
    held = None
    for _ in range(3 * CALLS):
        x = torch.randn(4, 8)
        out = decode(x, w)
        last = out[:, -1]
        token = sample(last, t)
        want = _logits(x, w)[:, -1] / t
        torch.testing.assert_close(last, want)
        assert torch.equal(token, want.argmax(-1))
        held = out  # kept until after the next decode call, as a loop variable is
        del out, last
    assert held is not None
    assert len(decode.events) <= 2, [e.reason for e in decode.events]
    # one capture per decode output it is given, and the first call's (the decode's own run
    # returns a copy): bounded, not one per call
    assert len(sample.events) <= 4, [e.reason for e in sample.events]


def test_a_compiled_sampler_scaling_held_logits_in_place_is_not_a_capture_per_call() -> None:
    """The same through torch.compile (backend npugraph_ex): two compiled functions in a loop."""
    pytest.importorskip("npugraph_backend")  # registers the backend; absent in the runtime's own run
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 3 * 32).eval()
    def decode(x: torch.Tensor) -> torch.Tensor:
        return lin(x).view(4, 3, 32)
    def sample(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits.div_(t)
        return logits.argmax(-1)
    cd = torch.compile(decode, backend="npugraph_ex")
    cs = torch.compile(sample, backend="npugraph_ex")
    t = torch.tensor(0.7)
    with torch.no_grad():
        for _ in range(24):
            x = torch.randn(4, 16)
            out = cd(x)
            last = out[:, -1]
            token = cs(last, t)
            want = decode(x)[:, -1] / t
            torch.testing.assert_close(last, want)
            assert torch.equal(token, want.argmax(-1))
    made = {k: v for k, v in counters["npugraph_ex"].items()
            if k.startswith(("capture_due", "recapture_due"))}
    assert made and sum(made.values()) <= 6, made  # 24 calls: before, one sampler capture each
