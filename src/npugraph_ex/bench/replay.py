"""(b) The runtime's graph replay against the same ATen GraphModule run directly, and eager.

Two workloads: a transformer stack of about 200 ATen ops and the transformers Llama decode step.
The GraphModule is the AOTAutograd inference graph (what our backend compiles); the replay is
that graph captured by hand with ``npugraph_runtime.graph``. Target (issue 2): replay at most
0.6x the GraphModule's time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import npugraph_runtime as ngr
import torch
from torch import nn

from npugraph_ex.bench.backends import Traced, trace_aot
from npugraph_ex.bench.context import BenchContext, fmt_exc
from npugraph_ex.bench.report import Figure, Section
from npugraph_ex.bench.timing import measure_interleaved
from npugraph_ex.models import build_decoder, synchronize

TARGET = 0.6
STACK_OPS = 200


class _Block(nn.Module):
    """A pre-norm transformer block with explicit (matmul + softmax) attention."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        att = torch.softmax((q @ k.transpose(-1, -2)) * (h // self.heads) ** -0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, h))
        out: torch.Tensor = x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))
        return out


class TransformerStack(nn.Module):
    def __init__(self, blocks: int, hidden: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(_Block(hidden, heads) for _ in range(blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.blocks(x)
        return out


def stack_of_about(ops: int, device: torch.device) -> tuple[nn.Module, torch.Tensor, Traced]:
    """A stack whose ATen graph has about `ops` ops, with its input and traced graph."""
    torch.manual_seed(0)
    x = torch.randn(4, 16, 64, device=device)
    with torch.device(device):
        one = TransformerStack(1).eval()
    per_block = trace_aot(one, x).ops()
    blocks = max(1, round(ops / per_block))
    with torch.device(device):
        model = TransformerStack(blocks).eval().requires_grad_(False)
    return model, x, trace_aot(model, x)


def run(ctx: BenchContext) -> Section:
    sec = Section("b", "runtime replay vs GraphModule vs eager", bar_unit="µs per call")
    workloads: list[tuple[str, Callable[[], tuple[Callable[[], Any], Traced, Callable[[], None] | None]]]] = [
        (f"transformer stack (~{STACK_OPS} ops)", lambda: _stack(ctx)),
        ("llama decode step", lambda: _llama(ctx)),
    ]
    if ctx.quick:
        workloads = workloads[:1]
    for label, build in ctx.steps(workloads, desc="replay"):
        eager, traced, restore = build()
        _one(ctx, sec, label, eager, traced, restore)
    return sec


def _stack(ctx: BenchContext) -> tuple[Callable[[], Any], Traced, None]:
    model, x, traced = stack_of_about(STACK_OPS, ctx.device)
    return (lambda: model(x)), traced, None


def _llama(ctx: BenchContext) -> tuple[Callable[[], Any], Traced, Callable[[], None]]:
    dec = build_decoder("llama", "tiny" if ctx.on_cpu else "1b", ctx.device,
                        max_len=64 if ctx.on_cpu else 256)
    token = dec.prefill(dec.prompt(8))
    position = dec.position(8)
    restore = dec.checkpoint()  # every call decodes from the same cache state
    traced = trace_aot(dec.step, token, position)
    restore()
    return (lambda: dec.step(token, position)), traced, restore


def _one(ctx: BenchContext, sec: Section, label: str, eager: Callable[[], Any], traced: Traced,
         restore: Callable[[], None] | None) -> None:
    dev = ctx.device
    prepare = restore or (lambda: None)
    prepare()
    with torch.no_grad():
        reference = traced()
    fns: dict[str, Callable[[], Any]] = {"eager": eager, "GraphModule": traced}
    entry: dict[str, Any] = {"aten_ops": traced.ops()}
    same = False
    try:
        g = ngr.Graph(dev)
        with torch.no_grad():
            prepare()
            with ngr.graph(g):
                static_out = traced()
            prepare()
            g.replay()
        synchronize(dev)
        same = _equal(static_out, reference)
        fns["ours: replay"] = g.replay
        if hasattr(g, "recorded_ops"):
            entry["recorded_ops"] = int(g.recorded_ops())
    except Exception as exc:  # a capture failure is a finding, reported as such
        sec.figures.append(Figure.skip(f"{label}: replay / GraphModule",
                                       f"capture failed: {fmt_exc(exc)}", f"<= {TARGET}x"))
    if dev.type == "cuda":
        prepare()
        fns["torch.cuda.CUDAGraph replay"] = _torch_cuda_graph(traced)
    with torch.no_grad():
        timings = measure_interleaved(fns, device=dev, runs=ctx.runs, setup=restore,
                                      max_inner=40)
    prepare()
    us = {name: t.median * 1e6 for name, t in timings.items()}
    entry.update({f"{name} (µs)": v for name, v in us.items()})
    sec.figures.append(Figure(f"{label}: ATen ops", float(traced.ops()), ""))
    sec.figures.append(Figure(f"{label}: eager", us["eager"], "µs"))
    sec.figures.append(Figure(f"{label}: GraphModule", us["GraphModule"], "µs"))
    if "ours: replay" in us:
        ratio = us["ours: replay"] / us["GraphModule"]
        entry["replay_equals_graphmodule"] = same
        sec.figures.append(Figure(f"{label}: replay", us["ours: replay"], "µs",
                                  note="" if same else "output differs from GraphModule"))
        sec.figures.append(Figure.check(f"{label}: replay / GraphModule", ratio, "x",
                                        f"<= {TARGET}x", ratio <= TARGET and same))
        sec.figures.append(Figure(f"{label}: replay / eager", us["ours: replay"] / us["eager"], "x"))
    if "torch.cuda.CUDAGraph replay" in us:
        sec.figures.append(Figure(f"{label}: torch.cuda.CUDAGraph replay",
                                  us["torch.cuda.CUDAGraph replay"], "µs"))
    sec.data[label] = entry
    sec.bars[label] = us


def _torch_cuda_graph(traced: Traced) -> Callable[[], None]:
    """torch's own CUDA graph of the same GraphModule, for reference: its replay."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        traced()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        traced()
    return g.replay


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
