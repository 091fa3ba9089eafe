"""Tensor-parallel decode on 2 gloo ranks (127.0.0.1): a Llama-style decoder sharded
column/row-parallel with all_reduce, a static KV cache per rank holding its KV heads, compiled
with backend="npugraph_ex"; every rank's tokens equal the single-process model's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from npugraph_ex import tp

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
TOKENS = 10


def test_shards_cut_from_the_model_partition_its_weights() -> None:
    full = tp.build()
    parts = [tp.LlamaTP.shard(full, r, 2) for r in range(2)]
    layer = full.blocks[0]
    q = torch.cat([p.blocks[0].q_proj.weight for p in parts])
    o = torch.cat([p.blocks[0].o_proj.weight for p in parts], dim=1)
    assert torch.equal(q, layer.q_proj.weight) and torch.equal(o, layer.o_proj.weight)
    assert parts[0].blocks[0].k_cache.shape[1] == full.cfg.kv_heads // 2


def test_world_that_does_not_split_the_heads_is_refused() -> None:
    with pytest.raises(ValueError, match="world size 3 does not divide heads=4"):
        tp.TPConfig().check_world(3)


def test_tp_decode_on_two_ranks_equals_single_process_tokens() -> None:
    want = tp.single_process_tokens(TOKENS)
    ranks = tp.spawn(2, TOKENS, join_s=120)
    for r in ranks:
        assert "error" not in r, r
        # one capture, plus one more of the same key because the loop holds the last logits
        assert r["captured"] == 2 and r["held_output_captures"] == 1, r
        assert r["fallbacks"] == 0, r
        assert r["eager_tokens"] == want
        assert r["tokens"] == want


def test_demo_tp2_prints_identical_tokens(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "npugraph_ex.cli", "demo", "--tp", "2", "--tokens", "6",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "on every rank: yes" in proc.stdout
    doc = json.loads((tmp_path / "demo_tp.json").read_text())
    assert doc["tokens_identical"] and [r["captured"] for r in doc["ranks"]] == [2, 2]
