"""Mutated inputs that are new tensors on every call (a fresh input updated in place, a state fed
back): the key copies them into buffers of its own and back, instead of capturing on every call
(one capture a call before, ~90x slower than eager on a small graph). Each result equals eager's,
the caller's tensor is updated in place as in eager, and what the graph returns of it is the
caller's tensor or a view of it. A request's tensor (a KV cache used for several calls) keeps
the address rule: it is never copied."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from npugraph_runtime import make_graphed_callable
from npugraph_runtime.bindings import Binding, slot_bindings
from npugraph_runtime.copied_inputs import LIVES
from torch._dynamo.utils import counters

CALLS = 10


def scale_in_place(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x.mul_(2.0).add_(1.0)
    return x @ w, x, x[1:].t()


def _captures(fn: object) -> int:
    return len(fn.events)  # type: ignore[attr-defined]


def _copied(name: str) -> int:
    return counters["npugraph_ex"][f"copied_inputs_{name}"]


def _same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    # a function, so that no loop variable keeps a view of the input alive after the call
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e)


@pytest.fixture
def w() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(8, 8)


@pytest.mark.parametrize("policy", [{}, {"warmup": 0}, {"clone_output": True},
                                    {"clone_input": False}, {"warmup": 2}],
                         ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "default")
def test_a_fresh_input_updated_in_place_is_copied(w: torch.Tensor, policy: dict[str, object]) -> None:
    fn = make_graphed_callable(scale_in_place, (torch.randn(4, 8), w), static_argnums=(1,),
                               mutated_argnums=(0,), **policy)
    kept: list[torch.Tensor] = []
    for step in range(CALLS):
        x = torch.randn(4, 8)
        want_x = x.clone()
        want = scale_in_place(want_x, w)
        got = fn(x, w)
        torch.testing.assert_close(x, want_x)  # the caller's tensor, updated in place
        _same(got, want)
        assert got[1] is x  # the input itself, as eager returns it
        assert got[2].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        if step % 3 == 0:
            x.zero_()  # the caller writes its tensor: the view it got sees it, as in eager
            torch.testing.assert_close(got[2], torch.zeros(3, 8).t())
        if kept:  # the previous result, kept across this call, stays as it was
            torch.testing.assert_close(*kept)
        kept = [got[0], want[0]]  # its input dropped
        del got, x
    assert _captures(fn) <= 4, [e.reason for e in fn.events]
    assert _copied(fn.name) == 1


def test_a_state_fed_back_and_updated_in_place_is_copied(w: torch.Tensor) -> None:
    def step(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h.add_(torch.tanh(x @ w))
        return h * 0.5

    h0 = torch.zeros(4, 8)
    fn = make_graphed_callable(step, (h0.clone(), torch.randn(4, 8), w), static_argnums=(2,),
                               mutated_argnums=(0,))
    h, want = h0.clone(), h0.clone()
    for _ in range(3 * CALLS):
        x = torch.randn(4, 8)
        h, want = fn(h, x, w), step(want, x, w)
        torch.testing.assert_close(h, want)
    assert _captures(fn) <= 4, [e.reason for e in fn.events]
    assert _copied(fn.name) == 1


def test_a_request_cache_keeps_its_address_and_is_never_copied(w: torch.Tensor) -> None:
    def decode(cache: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        cache.mul_(0.5).add_(x @ w)
        return cache.sum(0)

    fn = make_graphed_callable(decode, (torch.zeros(4, 8), torch.randn(4, 8), w),
                               static_argnums=(2,), mutated_argnums=(0,))
    for request in range(4):
        cache, want_cache = torch.zeros(4, 8), torch.zeros(4, 8)
        for _ in range(2 + request % 2):  # a few decode steps, then the request ends
            x = torch.randn(4, 8)
            torch.testing.assert_close(fn(cache, x, w), decode(want_cache, x, w))
            torch.testing.assert_close(cache, want_cache)
        del cache
    assert _copied(fn.name) == 0
    assert _captures(fn) == 4  # one a request


def test_a_call_that_does_not_fit_the_buffers_leaves_copying(w: torch.Tensor) -> None:
    fn = make_graphed_callable(scale_in_place, (torch.randn(4, 8), w), static_argnums=(1,),
                               mutated_argnums=(0,))
    for _ in range(4):
        x = torch.randn(4, 8)
        fn(x, w)
    assert _copied(fn.name) == 1
    for _ in range(3):  # a view at an offset of a bigger tensor: not the whole of its storage
        base = torch.randn(6, 8)
        x, want_base = base[2:], base.clone()
        got, want = fn(x, w), scale_in_place(want_base[2:], w)
        torch.testing.assert_close(base, want_base)  # only the view's rows were written
        torch.testing.assert_close(got[0], want[0])
        assert got[1] is x
        del base, x
    for _ in range(3):
        x = torch.randn(4, 8)
        want_x = x.clone()
        torch.testing.assert_close(fn(x, w)[0], scale_in_place(want_x, w)[0])
        torch.testing.assert_close(x, want_x)


def test_inputs_sharing_memory_are_not_copied(w: torch.Tensor) -> None:
    def both(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a.add_(1.0)
        b.mul_(2.0)
        return (a + b) @ w

    fn = make_graphed_callable(both, (torch.randn(2, 8), torch.randn(2, 8), w),
                               static_argnums=(2,), mutated_argnums=(0, 1))
    for _ in range(6):
        base = torch.randn(4, 8)
        want_base = base.clone()
        got = fn(base[:2], base[2:], w)
        want = both(want_base[:2], want_base[2:], w)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(base, want_base)
    assert _copied(fn.name) == 0


# --- a request whose cache lives for many calls, after requests of one call each ------------
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


def _copying_decoder(seed: int) -> tuple[Any, torch.Tensor]:
    """A decode step after requests of one call each: its key copies the cache."""
    torch.manual_seed(seed)
    w = torch.randn(8, 8)
    fn = make_graphed_callable(decode, (torch.zeros(4, 8), torch.randn(4, 8), w),
                               static_argnums=(2,), mutated_argnums=(0,))
    _one_call_requests(fn, w)
    return fn, w


def _copying(fn: object) -> bool:
    return bool(fn._copied)  # type: ignore[attr-defined]


def test_a_long_request_after_one_call_requests_is_not_copied() -> None:
    fn, w = _copying_decoder(0)
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


def _serving_binding(fn: Any, slot: int) -> Binding:
    """The binding of ``slot`` in the capture whose replay closure serves the key now."""
    (key,) = fn._captures
    cap = next(c for c in fn._captures[key] if c.replay is fn._runs[key])
    return slot_bindings(fn._slots, cap, fn._copied.get(key))[slot]


def test_a_copied_slot_is_a_binding_of_the_capture_that_serves_it() -> None:
    """No run path beside the replay closure: while the key copies, the closure the hot path
    calls is a capture's, with the cache slot COPY_IN_OUT; once a request's cache lives, the
    closures are generated again and it is PINNED."""
    fn, w = _copying_decoder(2)
    assert _copying(fn)
    assert _serving_binding(fn, 0) is Binding.COPY_IN_OUT
    assert _serving_binding(fn, 2) is Binding.PINNED
    cache = torch.randn(4, 8)
    want_cache = cache.clone()
    for _ in range(STEPS):
        x = torch.randn(4, 8)
        torch.testing.assert_close(fn(cache, x, w), decode(want_cache, x, w))
        torch.testing.assert_close(cache, want_cache)
    assert not _copying(fn)
    assert _serving_binding(fn, 0) is Binding.PINNED


def test_two_long_requests_in_turn_after_one_call_requests_are_not_copied() -> None:
    fn, w = _copying_decoder(1)
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
