"""(s) The seed's multi-stream scenario: two independent matmul branches on two streams of one
captured graph (joined by events), against the same model on one stream, both compiled by
npugraph_ex with fullgraph=True. Every replay is checked against eager; captures and recompiles
are counted. The ratio is what a GPU gains from running the branches side by side; the CPU's
streams are logical (a CPU replay runs the ops in order), so there only correctness means
anything and the ratio is reported for information."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import npugraph_runtime as ngr
import torch

from npugraph_ex.bench._compat import dynamo_counters
from npugraph_ex.bench.backends import captures, counter_snapshot
from npugraph_ex.bench.context import BenchContext, fmt_exc
from npugraph_ex.bench.report import Figure, Section
from npugraph_ex.bench.timing import measure_interleaved

CHECKS = 5


def _branch(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    for w in weights:
        x = torch.relu(x @ w)
    return x


def branches(device: torch.device, quick: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """(left weights, right weights, batch): each branch a few square matmuls, small enough that
    one branch leaves a GPU's SMs idle (which is when a second stream pays)."""
    width, depth = (128, 2) if quick or device.type == "cpu" else (1024, 4)
    gen = torch.Generator().manual_seed(0)

    def weights() -> list[torch.Tensor]:
        return [(torch.randn(width, width, generator=gen) / width**0.5).to(device)
                for _ in range(depth)]

    return weights(), weights(), (32 if device.type == "cpu" else 256)


def models(device: torch.device, left: list[torch.Tensor], right: list[torch.Tensor]) -> dict[
        str, Callable[[torch.Tensor], torch.Tensor]]:
    """The eager reference, the one-stream model and the two-stream model (same values)."""
    side1, side2 = ngr.Stream(device), ngr.Stream(device)

    def one_stream(x: torch.Tensor) -> torch.Tensor:
        return _branch(x, left) + _branch(x, right)

    def two_streams(x: torch.Tensor) -> torch.Tensor:
        start = ngr.Event(device)
        start.record()
        with ngr.stream(side1):
            start.wait()
            a = _branch(x, left)
            done1 = ngr.Event(device)
            done1.record()
        with ngr.stream(side2):
            start.wait()
            b = _branch(x, right)
            done2 = ngr.Event(device)
            done2.record()
        done1.wait()
        done2.wait()
        return a + b

    return {"eager": one_stream, "one stream": one_stream, "two streams": two_streams}


def _graphs() -> int:
    return int(dynamo_counters().get("stats", {}).get("unique_graphs", 0))


def run(ctx: BenchContext) -> Section:
    sec = Section("s", "two matmul branches: two streams vs one", bar_unit="us per call")
    device = ctx.device
    left, right, batch = branches(device, ctx.quick)
    fns = models(device, left, right)
    eager = fns.pop("eager")
    compiled: dict[str, Any] = {}
    facts: dict[str, dict[str, Any]] = {}
    with torch.inference_mode():
        for label, fn in fns.items():
            torch.compiler.reset()
            # the new graphs' captures only: an earlier section's graphs, freed while this one
            # runs, lower their own counters (torch 2.11 frees them later than 2.13.0 does)
            before = counter_snapshot()
            graphs_before = _graphs()
            try:
                c = torch.compile(fn, backend="npugraph_ex", fullgraph=True)
                equal = True
                for _ in range(CHECKS):  # fresh inputs each call: the replay path
                    x = torch.randn(batch, left[0].shape[0], device=device)
                    equal = equal and bool(torch.allclose(c(x), eager(x), rtol=1e-4, atol=1e-4))
            except Exception as exc:
                sec.figures.append(Figure.skip(label, f"compile or replay failed: {fmt_exc(exc)}"))
                continue
            compiled[label] = c
            facts[label] = {
                "replays_equal_eager": equal,
                "captures": captures(before),
                # torch 2.13 counts a recompile as one more graph, not in counters["recompiles"]
                "recompiles": _graphs() - graphs_before - 1,
            }
            sec.figures.append(Figure.check(
                f"{label}: {CHECKS} replays equal eager, {facts[label]['captures']} capture(s)",
                float(facts[label]["captures"]), "captures", "equal eager, >= 1 capture",
                equal and facts[label]["captures"] >= 1))
        if len(compiled) == 2:
            x = torch.randn(batch, left[0].shape[0], device=device)
            calls: dict[str, Callable[[], object]] = {
                label: functools.partial(c, x) for label, c in compiled.items()}
            timings = measure_interleaved(calls, device=device, runs=ctx.runs)
            sec.bars["median per call"] = {k: t.median * 1e6 for k, t in timings.items()}
            sec.data["timings"] = {k: t.as_dict() for k, t in timings.items()}
            ratio = timings["two streams"].median / timings["one stream"].median
            note = ("CPU streams are logical (replayed in order): for information only"
                    if ctx.on_cpu else "below 1 means the branches overlapped")
            sec.figures.append(Figure("two streams / one stream (median per call)", ratio, "x",
                                      note=note))
    sec.data.update(batch=batch, width=int(left[0].shape[0]), depth=len(left), results=facts)
    return sec
