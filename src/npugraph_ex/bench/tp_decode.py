"""(i) The decode step of a 2-rank tensor-parallel Llama-style decoder on the CPU (gloo on
127.0.0.1, npugraph_ex.tp), eager against npugraph_ex, side by side.

One step = one token through the rank's shard at a fixed position (the KV cache write is the
same every time), four all_reduces per step. Both ranks time the same calls in rounds (a barrier,
then ``inner`` eager steps, a barrier, ``inner`` compiled steps), in wall-clock time: a step
includes waiting for the other rank, which a thread CPU clock would not count."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from npugraph_ex import tp
from npugraph_ex.bench.context import BenchContext
from npugraph_ex.bench.report import Figure, Section

WORLD = 2


def _time_steps(rank: int, world: int, runs: int, inner: int) -> dict[str, Any]:
    full = tp.build()
    model = tp.LlamaTP.shard(full, rank, world).eval()
    ids = tp.prompt(full.cfg)
    with torch.no_grad():
        token = model(ids, torch.arange(ids.shape[1]))[:, -1].argmax(-1, keepdim=True)
        pos = torch.tensor([ids.shape[1]])
        compiled = torch.compile(model, backend=tp.BACKEND, fullgraph=True, dynamic=False)
        for _ in range(3):  # compile, warm up, capture
            got = compiled(token, pos).clone()
        same = bool(torch.equal(got, model(token, pos)))
        samples: dict[str, list[float]] = {"eager": [], "npugraph_ex": []}
        fns: dict[str, Callable[..., torch.Tensor]] = {"eager": model, "npugraph_ex": compiled}
        for _ in range(runs):
            for name, fn in fns.items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(inner):
                    fn(token, pos)
                samples[name].append((time.perf_counter() - start) / inner)
    counters = tp._counters()
    return {"same_logits": same,
            "captured": sum(v for k, v in counters.items() if k.startswith("captured_")),
            **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in samples.items()},
            **{f"{k}_p90_ms": 1e3 * sorted(v)[int(0.9 * (len(v) - 1))] for k, v in samples.items()}}


def bench_rank(rank: int, world: int, port: int, out: str, runs: int, inner: int) -> None:
    tp.as_rank(rank, world, port, out, 1, 60, lambda: _time_steps(rank, world, runs, inner))


def run(ctx: BenchContext) -> Section:
    sec = Section("i", "2-rank tensor-parallel decode step (CPU, gloo)", bar_unit="ms per step")
    if not dist.is_available() or not dist.is_gloo_available():
        sec.figures.append(Figure.skip("tp2 decode step", "torch.distributed with gloo missing"))
        return sec
    inner = 5 if ctx.quick else 20
    ranks = tp.spawn(WORLD, target=bench_rank, args=(ctx.runs, inner), join_s=300)
    errors = [f"rank {r['rank']}: {r['error']}" for r in ranks if "error" in r]
    if errors:
        raise RuntimeError("; ".join(errors))
    sec.data["ranks"] = ranks
    sec.data["config"] = tp.config_dict()
    sec.data["samples"] = {"runs": ctx.runs, "inner": inner, "clock": "wall"}
    for r in ranks:
        label = f"tp2 rank {r['rank']}"
        note = "" if r["same_logits"] else "logits differ from eager"
        sec.figures.append(Figure(f"{label} eager step", r["eager_ms"], "ms"))
        sec.figures.append(Figure(f"{label} npugraph_ex step", r["npugraph_ex_ms"], "ms", note=note))
        sec.figures.append(Figure(f"{label} npugraph_ex / eager", r["npugraph_ex_ms"] / r["eager_ms"], "x"))
        sec.figures.append(Figure.check(f"{label} captured once", float(r["captured"]), "", "== 1",
                                        r["captured"] == 1))
        sec.bars[f"{label} decode step"] = {"eager": r["eager_ms"],
                                            "ours (npugraph_ex)": r["npugraph_ex_ms"]}
    return sec
