"""(a) Host overhead of the replay path and (g) that overhead with logging configured but
disabled and with no profiler active.

The workload: a graph with 4 user inputs and 100 parameters (50 small linear layers). Our
overhead = a call of the function compiled with backend="npugraph_ex" minus a bare replay of the
device graph our compiler captured for it (the same graph, reached through the public
``npugraph_ex.compile_fx`` on the same AOT graph). aot_eager's overhead = its compiled call minus
its AOT GraphModule run directly. Targets: issue 3, ours <= 10 µs and below aot_eager's; issue 6,
the (g) figures unchanged within noise (<= baseline + max(1 µs, 10%))."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from npugraph_ex.bench._compat import aot_graph_backend
from npugraph_ex.bench.backends import (
    OURS,
    compile_with,
    ours_backend,
    ours_missing_reason,
    trace_aot,
)
from npugraph_ex.bench.context import BenchContext, fmt_exc
from npugraph_ex.bench.report import Figure, Section
from npugraph_ex.bench.timing import inner_for, measure

TARGET_US = 10.0
LAYERS = 50  # 50 x (weight, bias) = 100 parameters


class FourInputs(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(LAYERS))

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                d: torch.Tensor) -> torch.Tensor:
        h = a * b + c - d
        for layer in self.layers:
            h = torch.relu(layer(h))
        return h


class Workload:
    """The model, its inputs, and each way of running it, built once for (a) and (g)."""

    def __init__(self, ctx: BenchContext) -> None:
        self.ctx = ctx
        torch.manual_seed(0)
        with torch.device(ctx.device):
            self.model = FourInputs().eval().requires_grad_(False)
            self.inputs = [torch.randn(8, 16, device=ctx.device) for _ in range(4)]
        assert sum(1 for _ in self.model.parameters()) == 2 * LAYERS
        torch.compiler.reset()
        self.traced = trace_aot(self.model, *self.inputs)
        self.aot_eager = compile_with(self.model, "aot_eager")
        self.ours: Callable[..., Any] | None = None
        self.replay: Callable[[], None] | None = None
        self.why_not = ""
        try:
            self._build_ours()
        except Exception as exc:  # ours failing is a finding: reported, the rest still runs
            self.why_not = f"npugraph_ex fails on this graph: {fmt_exc(exc)}"
            self.ours = None

    def _build_ours(self) -> None:
        if ours_backend() is None:
            self.why_not = ours_missing_reason()
            return
        try:
            from npugraph_backend import compile_fx  # what npugraph_ex.compile_fx re-exports
        except ImportError as exc:
            self.why_not = f"compile_fx does not import: {exc}"
            return
        kept: list[Any] = []

        def fw(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            compiled = compile_fx(gm, example_inputs)
            kept.append(compiled)
            return compiled

        via_fx = torch.compile(self.model, backend=aot_graph_backend(fw), fullgraph=True,
                               dynamic=False)
        with torch.no_grad():
            for _ in range(3):
                via_fx(*self.inputs)
        graphs = getattr(getattr(kept[0], "runner", None), "graphs", {}) if kept else {}
        if len(graphs) != 1:
            self.why_not = f"compile_fx kept {len(graphs)} captured graphs, expected 1"
            return
        self.replay = next(iter(graphs.values())).replay
        self.ours = compile_with(self.model, OURS)
        with torch.no_grad():
            for _ in range(3):
                out = self.ours(*self.inputs)
            expected = self.model(*self.inputs)
        if not torch.allclose(out, expected, rtol=1e-4, atol=1e-5):
            self.why_not = "the compiled output differs from eager"
            self.ours = None

    def time_us(self, fn: Callable[[], Any]) -> float:
        dev = self.ctx.device
        with torch.no_grad():
            runs = max(self.ctx.runs, 40)
            return measure(fn, device=dev, runs=runs, warmup=20,
                           inner=inner_for(fn, dev, 4e-3)).median * 1e6

    def call(self, compiled: Callable[..., Any]) -> Callable[[], Any]:
        a, b, c, d = self.inputs
        return lambda: compiled(a, b, c, d)

    def our_overhead(self) -> tuple[float, float]:
        """(compiled call, bare replay) in µs, measured back to back."""
        assert self.ours is not None and self.replay is not None
        call_us = self.time_us(self.call(self.ours))
        replay_us = self.time_us(self.replay)
        return call_us, replay_us


_workload: Workload | None = None


def workload(ctx: BenchContext) -> Workload:
    global _workload
    if _workload is None or _workload.ctx is not ctx:
        _workload = Workload(ctx)
    return _workload


def run_overhead(ctx: BenchContext) -> Section:
    sec = Section("a", "replay-path host overhead (4 user inputs, 100 parameters)",
                  bar_unit="µs per call")
    w = workload(ctx)
    gm_us = w.time_us(w.traced)
    aot_us = w.time_us(w.call(w.aot_eager))
    eager_us = w.time_us(w.call(w.model))
    aot_overhead = aot_us - gm_us
    bars = {"eager": eager_us, "aot_eager call": aot_us, "AOT GraphModule": gm_us}
    sec.data.update(eager_us=eager_us, aot_eager_call_us=aot_us, aot_graphmodule_us=gm_us,
                    aot_eager_overhead_us=aot_overhead, aten_ops=w.traced.ops())
    sec.figures.append(Figure("aot_eager overhead over its GraphModule", aot_overhead, "µs"))
    if w.ours is None:
        sec.figures.append(Figure.skip("ours: overhead over bare replay", w.why_not,
                                       f"<= {TARGET_US} µs"))
    else:
        call_us, replay_us = w.our_overhead()
        overhead = call_us - replay_us
        bars.update({"ours: compiled call": call_us, "ours: bare replay": replay_us})
        sec.data.update(ours_call_us=call_us, ours_replay_us=replay_us, ours_overhead_us=overhead)
        sec.figures.append(Figure.check("ours: overhead over bare replay", overhead, "µs",
                                        f"<= {TARGET_US} µs", overhead <= TARGET_US))
        sec.figures.append(Figure.check("ours overhead - aot_eager overhead",
                                        overhead - aot_overhead, "µs", "< 0",
                                        overhead < aot_overhead))
        sec.figures.append(Figure("ours: compiled call / eager", call_us / eager_us, "x"))
    sec.bars["per call"] = bars
    return sec


def _close(value: float, base: float) -> bool:
    return value <= base + max(1.0, 0.1 * abs(base))


def run_quiet(ctx: BenchContext) -> Section:
    sec = Section("g", "replay-path overhead with logging disabled and no profiler",
                  bar_unit="µs overhead per call")
    w = workload(ctx)
    if w.ours is None:
        sec.figures.append(Figure.skip("ours: overhead", w.why_not))
        return sec
    logger = logging.getLogger("npugraph_ex")
    base_call, base_replay = w.our_overhead()
    base = base_call - base_replay
    # Logging configured (a handler, propagation) but below its level: must cost nothing.
    handler = logging.StreamHandler(io.StringIO())
    old_level, old_propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        call, replay = w.our_overhead()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logger.propagate = old_propagate
    logged = call - replay
    # A profiler that ran and stopped: its record_function ranges must cost nothing after.
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]), torch.no_grad():
            for _ in range(5):
                w.call(w.ours)()
        call, replay = w.our_overhead()
        profiled_after = call - replay
    except Exception as exc:  # the profiler is optional on some builds
        sec.figures.append(Figure.skip("after a profiler session", fmt_exc(exc)))
        profiled_after = None
    target = "<= baseline + max(1 µs, 10%)"
    sec.figures.append(Figure("overhead, default logging, no profiler (baseline)", base, "µs"))
    sec.figures.append(Figure.check("overhead, logging configured but disabled", logged, "µs",
                                    target, _close(logged, base)))
    bars = {"baseline": base, "logging configured, disabled": logged}
    if profiled_after is not None:
        sec.figures.append(Figure.check("overhead, no profiler active (after one ran)",
                                        profiled_after, "µs", target, _close(profiled_after, base)))
        bars["no profiler (after one ran)"] = profiled_after
    sec.data.update(baseline_us=base, logging_disabled_us=logged,
                    after_profiler_us=profiled_after)
    sec.bars["overhead"] = bars
    return sec
