"""Adversarial user tests of the merged replay work (held outputs, grouped-KV attention,
kernel-decision cache, shared pools): each compares with eager over >= 5 fresh calls and asserts a
capture happened."""

from __future__ import annotations

import npugraph_runtime as ngr
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
