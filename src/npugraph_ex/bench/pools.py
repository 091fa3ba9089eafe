"""(e) Memory held by captures of 8 batch sizes, each in a private pool and all in one shared
pool (captured largest first, and smallest first), against the largest single capture alone.
Target (issues 7 and 14): shared <= 1.3x the largest single capture in either order. Bytes are
what ``npugraph_runtime.pool_bytes`` reports for the pools."""

from __future__ import annotations

from typing import Any

import npugraph_runtime as ngr
import torch

from npugraph_ex.bench.context import BenchContext, fmt_exc
from npugraph_ex.bench.replay import TransformerStack
from npugraph_ex.bench.report import Figure, Section

BATCHES = (128, 64, 32, 16, 8, 4, 2, 1)
TARGET = 1.3


def _held(callable_: Any) -> int:
    """Bytes held by the distinct pools of a GraphedCallable's captures."""
    pools: dict[Any, Any] = {}
    for g in callable_.graphs.values():
        pool = g.pool()
        pools.setdefault((str(pool.device), repr(pool.ident)), pool)
    return sum(int(ngr.pool_bytes(p)) for p in pools.values())


def _capture_all(model: Any, batches: tuple[int, ...], pool: str,
                 device: torch.device) -> tuple[int, int, bool, int]:
    """(pool bytes, captures, every replay equal to eager, bytes of the static outputs) for
    `batches` captured into `pool`."""
    x0 = torch.randn(batches[0], 16, 64, device=device)
    fn = ngr.make_graphed_callable(model, (x0,), pool=pool, device=device)
    got: Any
    ok = True
    with torch.no_grad():
        for b in batches:
            x = torch.randn(b, 16, 64, device=device)
            for _ in range(2):  # capture, then replay
                got = fn(x)
            ok = ok and bool(torch.allclose(got, model(x), rtol=1e-4, atol=1e-5))
        # Every capture must still replay correctly once all of them share the pool.
        outputs: dict[int, int] = {}
        for b in batches:
            x = torch.randn(b, 16, 64, device=device)
            got = fn(x)
            ok = ok and bool(torch.allclose(got, model(x), rtol=1e-4, atol=1e-5))
            storage = got.untyped_storage()
            outputs[storage.data_ptr()] = storage.nbytes()
    return _held(fn), int(fn.num_captures), ok, sum(outputs.values())


def run(ctx: BenchContext) -> Section:
    sec = Section("e", "memory held by 8 batch-size captures", bar_unit="MiB held")
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = TransformerStack(2 if ctx.quick else 4).eval().requires_grad_(False)
    results: dict[str, dict[str, Any]] = {}
    runs = [("largest alone", BATCHES[:1], "private"), ("private pools", BATCHES, "private"),
            ("shared pool", BATCHES, "shared"),
            ("shared pool, smallest first", BATCHES[::-1], "shared")]
    for label, batches, pool in ctx.steps(runs, desc="pools"):
        try:
            held, captures, ok, out_bytes = _capture_all(model, batches, pool, ctx.device)
        except Exception as exc:
            sec.figures.append(Figure.skip(label, f"capture failed: {fmt_exc(exc)}"))
            continue
        results[label] = {"bytes": held, "captures": captures, "replays_equal_eager": ok,
                          "static_output_bytes": out_bytes}
        notes = [] if ok else ["a replay differs from eager"]
        # The CPU pool holds intermediates; the static outputs stay live outside it (on
        # CUDA the allocator's pool holds both).
        notes.append(f"+ {out_bytes / 2**20:.2f} MiB of static outputs"
                     + (" outside the pool" if ctx.on_cpu else ", inside the pool"))
        sec.figures.append(Figure(f"{label}: {captures} capture(s)", held / 2**20, "MiB",
                                  note="; ".join(notes)))
    sec.data.update(batches=list(BATCHES), results=results)
    sec.bars["pool bytes"] = {k: v["bytes"] / 2**20 for k, v in results.items()}
    if "shared pool" in results and "largest alone" in results and results["largest alone"]["bytes"]:
        ratio = results["shared pool"]["bytes"] / results["largest alone"]["bytes"]
        ok = all(r["replays_equal_eager"] for r in results.values())
        sec.figures.append(Figure.check("shared pool / largest single capture", ratio, "x",
                                        f"<= {TARGET}x", ratio <= TARGET and ok))
        if "shared pool, smallest first" in results:
            ratio = results["shared pool, smallest first"]["bytes"] / results["largest alone"]["bytes"]
            sec.figures.append(Figure.check("shared pool, smallest first / largest single capture",
                                            ratio, "x", f"<= {TARGET}x", ratio <= TARGET and ok))
        if ctx.on_cpu:
            shared = results["shared pool"]
            largest = results["largest alone"]
            with_outputs = ((shared["bytes"] + shared["static_output_bytes"])
                            / (largest["bytes"] + largest["static_output_bytes"]))
            sec.figures.append(Figure.check("the same, counting the static outputs",
                                            with_outputs, "x", f"<= {TARGET}x",
                                            with_outputs <= TARGET and ok))
        if results.get("private pools", {}).get("bytes"):
            sec.figures.append(Figure("shared pool / private pools",
                                      results["shared pool"]["bytes"]
                                      / results["private pools"]["bytes"], "x"))
    return sec
