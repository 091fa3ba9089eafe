"""Copied mutated inputs (copied_inputs) against what a server does next: once a key copies (after
requests of one call each), a request whose KV cache lives for many calls goes back to the address
rules (its own capture replays, no copies of the whole cache twice a call), alone or with
another request served in turn; every result and cache equals eager's."""

from __future__ import annotations

import torch
from npugraph_runtime import make_graphed_callable
from npugraph_runtime.copied_inputs import LIVES
from torch._dynamo.utils import counters

STEPS = 8


def decode(cache: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    cache.mul_(0.5).add_(x @ w)
    return cache.sum(0)


def _one_call_requests(fn: object, w: torch.Tensor, n: int = 4) -> None:
    for _ in range(n):
        cache, want_cache, x = torch.zeros(4, 8), torch.zeros(4, 8), torch.randn(4, 8)
        torch.testing.assert_close(fn(cache, x, w), decode(want_cache, x, w))  # type: ignore[operator]
        torch.testing.assert_close(cache, want_cache)
        del cache


def _copying(fn: object) -> bool:
    return bool(fn._copied)  # type: ignore[attr-defined]


def test_a_long_request_after_one_call_requests_is_not_copied() -> None:
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    fn = make_graphed_callable(decode, (torch.zeros(4, 8), torch.randn(4, 8), w),
                               static_argnums=(2,), mutated_argnums=(0,))
    _one_call_requests(fn, w)
    assert counters["npugraph_ex"][f"copied_inputs_{fn.name}"] == 1
    assert _copying(fn)
    before = len(fn.events)
    for request in range(3):
        cache = torch.randn(4, 8)
        want_cache = cache.clone()
        for step in range(STEPS):
            x = torch.randn(4, 8)
            torch.testing.assert_close(fn(cache, x, w), decode(want_cache, x, w))
            torch.testing.assert_close(cache, want_cache)
            if step >= LIVES - 1:
                assert not _copying(fn), (request, step)  # replays its own capture
        del cache
    # one capture a request, as for requests that came before the key copied
    assert len(fn.events) - before == 3, [e.reason for e in fn.events]
    _one_call_requests(fn, w, 6)  # requests of one call again: copied again, no capture each
    assert _copying(fn)
    assert len(fn.events) - before <= 3 + 3, [e.reason for e in fn.events]


def test_two_long_requests_in_turn_after_one_call_requests_are_not_copied() -> None:
    torch.manual_seed(1)
    w = torch.randn(8, 8)
    fn = make_graphed_callable(decode, (torch.zeros(4, 8), torch.randn(4, 8), w),
                               static_argnums=(2,), mutated_argnums=(0,))
    _one_call_requests(fn, w)
    assert _copying(fn)
    before = len(fn.events)
    caches = [torch.randn(4, 8), torch.randn(4, 8)]
    wants = [c.clone() for c in caches]
    for step in range(2 * STEPS):
        k = step % 2
        x = torch.randn(4, 8)
        torch.testing.assert_close(fn(caches[k], x, w), decode(wants[k], x, w))
        for c, want in zip(caches, wants, strict=True):
            torch.testing.assert_close(c, want)
    assert not _copying(fn)
    assert len(fn.events) - before == 2, [e.reason for e in fn.events]  # one a request


def test_more_tensors_in_turn_than_capture_limit_stay_copied() -> None:
    """Six live caches served in turn, capture_limit=4: a capture each would not fit, so the key
    keeps copying (leaving it made every call capture, replacing a capture still in use)."""
    torch.manual_seed(2)
    w = torch.randn(8, 8)
    fn = make_graphed_callable(decode, (torch.zeros(4, 8), torch.randn(4, 8), w),
                               static_argnums=(2,), mutated_argnums=(0,), capture_limit=4)
    _one_call_requests(fn, w)
    before = len(fn.events)
    caches = [torch.randn(4, 8) for _ in range(6)]
    wants = [c.clone() for c in caches]
    for step in range(6 * STEPS):
        k = step % len(caches)
        x = torch.randn(4, 8)
        torch.testing.assert_close(fn(caches[k], x, w), decode(wants[k], x, w))
        torch.testing.assert_close(caches[k], wants[k])
    assert _copying(fn) and not fn.fell_back
    assert len(fn.events) == before, [e.reason for e in fn.events]
