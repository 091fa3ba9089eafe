"""Adversarial user tests of the merged replay work (held outputs, grouped-KV attention,
kernel-decision cache, shared pools): each compares with eager over >= 5 fresh calls and asserts a
capture happened."""

from __future__ import annotations

import weakref

import npugraph_runtime as ngr
import pytest
import torch
import torch.nn.functional as F
from npugraph_runtime._compat import npugraph_ex_counters

B, KV_HEADS, REP, SEQ, DIM = 1, 2, 2, 8, 16


def repeat_kv(x: torch.Tensor) -> torch.Tensor:
    return x[:, :, None].expand(B, KV_HEADS, REP, SEQ, DIM).reshape(B, KV_HEADS * REP, SEQ, DIM)


def scaled_keys_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    keys = repeat_kv(k)
    keys.mul_(2.0)  # the repeated copy is written after repeat_kv: attention must read it
    return F.scaled_dot_product_attention(q, keys, repeat_kv(v))


@torch.no_grad()
def test_grouped_kv_shortcut_refused_when_the_repeated_copy_is_written_after_the_clone() -> None:
    # Captured on a zero KV cache (a fresh StaticCache, static buffers made with torch.zeros):
    # there the scaled copy equals the cache bitwise, so only the recording can tell them apart.
    fn = ngr.make_graphed_callable(
        scaled_keys_attention,
        (torch.randn(B, KV_HEADS * REP, 1, DIM), torch.randn(B, KV_HEADS, SEQ, DIM),
         torch.randn(B, KV_HEADS, SEQ, DIM)),
        name="gqa_scaled")
    fn(torch.zeros(B, KV_HEADS * REP, 1, DIM), torch.zeros(B, KV_HEADS, SEQ, DIM),
       torch.randn(B, KV_HEADS, SEQ, DIM))
    assert npugraph_ex_counters()["captured_gqa_scaled"] == 1
    for _ in range(5):
        q = torch.randn(B, KV_HEADS * REP, 1, DIM)
        k, v = torch.randn(B, KV_HEADS, SEQ, DIM), torch.randn(B, KV_HEADS, SEQ, DIM)
        torch.testing.assert_close(fn(q, k, v), scaled_keys_attention(q, k, v))
    assert fn.num_captures == 1


def decay_into_cache(cache: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    cache.mul_(0.5).add_(x.sum(0))
    return cache * 2 + x[:1]


@pytest.mark.parametrize("clone_input", [True, False])
@torch.no_grad()
def test_user_input_cut_from_the_mutated_inputs_arena_without_overlap(clone_input: bool) -> None:
    # a KV cache and a scratch input cut from one arena: same storage, no shared byte, so the
    # replay reads the input as eager does (it used to be refused as sharing memory)
    arena, eager_arena = torch.zeros(10, 4), torch.zeros(10, 4)
    fn = ngr.make_graphed_callable(decay_into_cache, (arena[:6], arena[6:]), mutated_argnums=(0,),
                                   clone_input=clone_input, name=f"arena_{clone_input}")
    for _ in range(6):
        scratch = torch.randn(4, 4)
        arena[6:].copy_(scratch)
        eager_arena[6:].copy_(scratch)
        torch.testing.assert_close(fn(arena[:6], arena[6:]),
                                   decay_into_cache(eager_arena[:6], eager_arena[6:]))
        torch.testing.assert_close(arena, eager_arena)
    assert npugraph_ex_counters()[f"captured_arena_{clone_input}"] == 1


def test_user_input_overlapping_a_mutated_input_is_still_refused() -> None:
    arena = torch.zeros(10, 4)
    fn = ngr.make_graphed_callable(decay_into_cache, (arena[:6], arena[5:]), mutated_argnums=(0,),
                                   name="arena_overlap")
    with pytest.raises(ngr.PolicyError, match="user input 1 shares memory with mutated input 0"):
        fn(arena[:6], arena[5:])


def reads_the_arena_through_as_strided(cache: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    cache.add_(1)
    return x.as_strided((4,), (1,), 0) * 2  # storage offset 0: the cache's bytes


def test_disjoint_user_input_read_through_as_strided_into_the_mutated_bytes_is_refused() -> None:
    arena = torch.zeros(10, 4)
    fn = ngr.make_graphed_callable(reads_the_arena_through_as_strided, (arena[:6], arena[6:]),
                                   mutated_argnums=(0,), name="arena_as_strided")
    with pytest.raises(ngr.PolicyError, match="user input 1 shares memory with mutated input 0"):
        fn(arena[:6], arena[6:])


def relu_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w)


@torch.no_grad()
def test_autocast_state_selects_its_own_hand_written_graph() -> None:
    # captured in float32, then called under bf16 autocast (and back): eager computes in other
    # dtypes, so a replay of the float32 capture would return float32 values
    w = torch.randn(16, 8)
    fn = ngr.make_graphed_callable(relu_matmul, (torch.randn(4, 16), w), static_argnums=(1,),
                                   name="autocast")
    for call in range(6):
        x = torch.randn(4, 16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=call % 2 == 1):
            got, want = fn(x, w), relu_matmul(x, w)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)
    assert fn.num_captures == 2
    assert npugraph_ex_counters()["capture_due_to_new_key_autocast"] == 2


def write_kv(x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(0, pos, x)
    return cache.sum(0) * 1.5


@torch.no_grad()
def test_requests_with_their_own_caches_served_in_turn_replay_their_own_captures() -> None:
    # three requests, each with its own KV cache (a mutated input), decoded round-robin: each
    # cache gets its capture once, instead of a recapture on every call
    caches = [torch.zeros(8, 4) for _ in range(3)]
    eager = [c.clone() for c in caches]
    fn = ngr.make_graphed_callable(write_kv, (torch.randn(1, 4), torch.tensor([0]), caches[0]),
                                   mutated_argnums=(2,), name="requests")
    for step in range(5):
        for ours, ref in zip(caches, eager, strict=True):
            x, pos = torch.randn(1, 4), torch.tensor([step])
            torch.testing.assert_close(fn(x, pos, ours), write_kv(x, pos, ref))
            torch.testing.assert_close(ours, ref)
    assert fn.num_captures == 3
    assert npugraph_ex_counters()["recapture_due_to_mutated_input_change_requests"] == 2
    # a finished request drops its cache: the next request's capture replaces that one, so the
    # dropped cache is not kept alive by the capture
    dropped = weakref.ref(caches[1])
    del caches[1], eager[1]
    fresh, fresh_ref = torch.zeros(8, 4), torch.zeros(8, 4)
    for step in range(5):
        x, pos = torch.randn(1, 4), torch.tensor([step])
        torch.testing.assert_close(fn(x, pos, fresh), write_kv(x, pos, fresh_ref))
    torch.testing.assert_close(fresh, fresh_ref)
    assert fn.num_captures == 3
    assert dropped() is None
