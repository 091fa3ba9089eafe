"""`npugraph-ex demo --tp N`: tensor-parallel greedy decoding on N gloo ranks on 127.0.0.1.

Each rank holds its shard of a small Llama-style decoder (npugraph_ex.tp), decodes eagerly and
compiled with backend="npugraph_ex"; the tokens of every rank must equal the single-process
eager model's (exit 1 if not). Prints the captures per rank and the per-token latency of each,
and writes demo_tp.json into --out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from npugraph_ex import tp


def main(tokens: int, world: int, out: str, threads: int | None) -> int:
    if world < 2:
        print(f"--tp {world}: give 2 or more ranks (without --tp the demo runs on one process)")
        return 2
    tp.TPConfig().check_world(world)
    print(f"npugraph-ex demo --tp {world}: {world} gloo ranks on 127.0.0.1, a Llama-style decoder "
          f"({tp.TPConfig()}) sharded column/row-parallel; greedy decoding of {tokens} tokens")
    want = tp.single_process_tokens(tokens)
    ranks = tp.spawn(world, tokens, threads=threads or 1)
    failed = [r for r in ranks if "error" in r]
    for r in failed:
        print(f"rank {r['rank']} failed: {r['error']}")
    if failed:
        return 1
    same = all(r["tokens"] == want and r["eager_tokens"] == want for r in ranks)
    print(f"\ntokens identical to the single-process eager model on every rank: "
          f"{'yes' if same else 'NO'}")
    print(f"  single process: {want}")
    for r in ranks:
        if r["tokens"] != want or r["eager_tokens"] != want:
            print(f"  rank {r['rank']} eager: {r['eager_tokens']}\n  rank {r['rank']} ours:  {r['tokens']}")
    print("captures per rank: " + ", ".join(
        f"rank {r['rank']}: {r['captured']} ({r['held_output_captures']} of them for held outputs;"
        f" eager fallbacks {r['fallbacks']})" for r in ranks))
    print(f"\nper-token latency (median of steps after the first {tp.SKIP_STEPS}):")
    for r in ranks:
        print(f"  rank {r['rank']}: eager {r['eager_ms']:8.3f} ms   npugraph_ex {r['ours_ms']:8.3f} ms"
              f"   {r['eager_ms'] / r['ours_ms']:5.2f}x eager")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"world": world, "tokens": tokens, "config": tp.config_dict(),
                           "single_process_tokens": want, "tokens_identical": same, "ranks": ranks}
    (folder / "demo_tp.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nwrote {folder / 'demo_tp.json'}")
    return 0 if same else 1
