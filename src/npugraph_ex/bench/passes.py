"""(f) What the built-in passes do to the transformers Llama decode graph: ATen nodes before and
after each pass, and bytes copied into graph inputs per step before and after
input_inplace_pass. Target (issue 4): no whole-cache copy once input_inplace_pass has run.

Then a decoder with one stacked KV buffer per model, [layers, slots, positions, dim], each layer
writing its slice ``kc[layer].index_put_((slots, pos), k)`` (issue 26): bytes copied into the
buffers per step, and the step time of the graph before and after the passes and of its
npugraph_ex replay, side by side with eager in one run.
Target: no copy of a layer's slice, only the rows written."""

from __future__ import annotations

import copy
import statistics
from typing import Any

import torch

from npugraph_ex.bench.backends import trace_aot
from npugraph_ex.bench.context import BenchContext, fmt_exc
from npugraph_ex.bench.report import Figure, Section
from npugraph_ex.bench.timing import clock
from npugraph_ex.models import build_decoder

aten = torch.ops.aten
# In-place writes into a graph input and the argument holding what each one writes.
_PARTIAL_WRITES = {aten.index_copy_.default: 3, aten.index_put_.default: 2,
                   aten.slice_scatter.default: 1, aten.select_scatter.default: 1}


def _nbytes(node: Any) -> int:
    val = node.meta.get("val") if hasattr(node, "meta") else None
    if isinstance(val, torch.Tensor):
        return int(val.numel() * val.element_size())
    return 0


def copied_bytes(gm: torch.fx.GraphModule) -> int:
    """Bytes written into graph inputs per run: a copy_ writes its whole destination, an
    in-place index_copy_/index_put_ only the values it is given."""
    placeholders = {n for n in gm.graph.nodes if n.op == "placeholder"}
    total = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or not n.args or n.args[0] not in placeholders:
            continue
        if n.target is aten.copy_.default:
            total += _nbytes(n.args[0])
        elif n.target in _PARTIAL_WRITES and len(n.args) > _PARTIAL_WRITES[n.target]:
            total += _nbytes(n.args[_PARTIAL_WRITES[n.target]])
    return total


def _their_bytes() -> Any:
    try:
        from npugraph_passes.stats import bytes_copied_per_step
    except ImportError:
        return None
    return bytes_copied_per_step


class StackedKV(torch.nn.Module):
    """A decoder whose layers write and read their slice of one stacked KV buffer per model."""

    kc: torch.Tensor
    vc: torch.Tensor

    def __init__(self, layers: int, slots: int, positions: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("kc", torch.zeros(layers, slots, positions, dim))
        self.register_buffer("vc", torch.zeros(layers, slots, positions, dim))
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.out = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        kc, vc = self.kc, self.vc
        mask = torch.arange(kc.shape[2], device=x.device)[None, :] <= pos[:, None]
        for layer, (qkv, out) in enumerate(zip(self.qkv, self.out, strict=True)):
            q, k, v = qkv(x).chunk(3, dim=-1)
            kc[layer].index_put_((slots, pos), k)
            vc[layer].index_put_((slots, pos), v)
            keys, values = kc[layer][slots], vc[layer][slots]
            scores = (keys @ q[:, :, None]).squeeze(-1).masked_fill(~mask, float("-inf"))
            x = x + out((scores.softmax(-1)[:, :, None] * values).sum(1))
        return x


def _median_us(calls: dict[str, tuple[Any, list[Any]]], runs: int) -> dict[str, float]:
    """Median time (the bench clock) of each call, the runs interleaved."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.no_grad():
        for _ in range(runs):
            for name, (fn, args) in calls.items():
                start = clock()
                fn(*args)
                times[name].append((clock() - start) * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def stacked_kv_case(ctx: BenchContext, sec: Section, pm: Any, config: Any) -> None:
    layers, slots, positions, dim, batch = 2, 64, 256, 128, 16
    model = StackedKV(layers, slots, positions, dim).to(ctx.device).eval()
    x = torch.randn(batch, dim, device=ctx.device)
    slot_ids = torch.randperm(slots, device=ctx.device)[:batch]
    pos = torch.randint(0, positions, (batch,), device=ctx.device)
    traced = trace_aot(model, x, slot_ids, pos)
    gm, args = traced.gm, traced.args
    reference = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())
    theirs = _their_bytes()

    def step_bytes(g: torch.fx.GraphModule) -> int:
        return int(theirs(g, args)) if theirs is not None else copied_bytes(g)

    slice_bytes = slots * positions * dim * 4
    before = step_bytes(gm)
    with torch.no_grad():
        pm.run(gm, args, config)
    gm.recompile()
    after = step_bytes(gm)
    rows_bytes = 2 * layers * batch * dim * 4
    functional = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in (
        aten.index_put.default, aten.select_scatter.default, aten.clone.default))
    sec.figures.append(Figure("stacked KV: bytes copied into the buffers per step before passes",
                              float(before), "B", note=f"one layer's slice is {slice_bytes} B"))
    sec.figures.append(Figure.check(
        "stacked KV: bytes copied into the buffers per step after passes", float(after), "B",
        f"< one layer's slice ({slice_bytes} B): written in place", after < slice_bytes,
        note=f"the rows written are {rows_bytes} B (index_put_ in place, not counted as a copy)"))
    sec.figures.append(Figure.check("stacked KV: functional index_put/select_scatter/clone left",
                                    float(functional), "", "0", functional == 0))
    compiled = torch.compile(copy.deepcopy(model), backend="npugraph_ex")
    with torch.no_grad():
        for _ in range(3):  # captured, then replayed
            compiled(x, slot_ids, pos)
    times = _median_us({"eager": (model, [x, slot_ids, pos]), "before passes": (reference, args),
                        "after passes": (gm, args), "npugraph_ex replay": (compiled, [x, slot_ids, pos])},
                       max(5, ctx.runs))
    torch.compiler.reset()
    for name in ("before passes", "after passes", "npugraph_ex replay"):
        sec.figures.append(Figure(f"stacked KV: step time {name} / eager", times[name] / times["eager"],
                                  "x", note=f"{times[name]:.0f} us vs {times['eager']:.0f} us"))
    with torch.no_grad():
        a = [t.clone() for t in args]
        b = [t.clone() for t in args]
        want, got = reference(*a), gm(*b)
    same = all(torch.allclose(g, w) for g, w in zip(got, want, strict=True)) and all(
        torch.equal(u, v) for u, v in zip(a, b, strict=True))
    sec.figures.append(Figure.check("stacked KV: outputs and buffers equal the unoptimised graph",
                                    float(same), "", "== before passes", same))
    sec.data.update(stacked_kv={"bytes_before": before, "bytes_after": after, "slice_bytes": slice_bytes,
                                "median_us": times, "functional_left": functional})


def run(ctx: BenchContext) -> Section:
    sec = Section("f", "the passes' effect on the Llama decode graph", bar_unit="ATen nodes")
    try:
        from npugraph_backend import CompilerConfig
        from npugraph_passes import PassManager
    except ImportError as exc:
        sec.figures.append(Figure.skip("passes", f"not available: {fmt_exc(exc)}"))
        return sec
    dec = build_decoder("llama", "tiny", ctx.device, max_len=64)
    token = dec.prefill(dec.prompt(8))
    position = dec.position(8)
    restore = dec.checkpoint()  # each run below decodes from the same cache state
    traced = trace_aot(dec.step, token, position)
    gm, args = traced.gm, traced.args
    # One layer's keys (or values): a copy this large per step is a whole-cache copy.
    cache_bytes = min((t.numel() * t.element_size() for t in dec.cache_tensors() if t.dim() >= 3),
                      default=0)
    theirs = _their_bytes()

    def step_bytes(g: torch.fx.GraphModule) -> int:
        if theirs is not None:
            try:
                return int(theirs(g, args))
            except Exception:  # their signature may differ: fall back to ours, same definition
                pass
        return copied_bytes(g)

    nodes = {"before passes": len(gm.graph.nodes)}
    bytes_after: dict[str, int] = {"before passes": step_bytes(gm)}
    config = CompilerConfig()
    pm = PassManager.from_config(config)

    def observer(name: str, g: torch.fx.GraphModule, record: Any) -> None:
        bytes_after[name] = step_bytes(g)

    with torch.no_grad():
        records = pm.run(gm, args, config, observer=observer)
    gm.recompile()
    rows = []
    previous = "before passes"
    for rec in records:
        rows.append({"pass": rec.name, "nodes_before": rec.nodes_before,
                     "nodes_after": rec.nodes_after, "changed": rec.changed,
                     "seconds": rec.seconds, "bytes_copied_after": bytes_after.get(rec.name)})
        nodes[rec.name] = rec.nodes_after
        sec.figures.append(Figure(f"{rec.name}: nodes", float(rec.nodes_after), "",
                                  note=f"{rec.nodes_before} before"))
        if rec.name == "input_inplace_pass":
            before = bytes_after.get(previous, 0)
            after = bytes_after.get(rec.name, 0)
            sec.figures.append(Figure("bytes copied per step before input_inplace_pass",
                                      float(before), "B"))
            sec.figures.append(Figure.check(
                "bytes copied per step after input_inplace_pass", float(after), "B",
                f"< one cache tensor ({cache_bytes} B): no whole-cache copy",
                cache_bytes == 0 or after < cache_bytes))
        previous = rec.name
    if not any(r["pass"] == "input_inplace_pass" for r in rows):
        sec.figures.append(Figure.skip("bytes copied per step after input_inplace_pass",
                                       "input_inplace_pass did not run (not registered yet)",
                                       "no whole-cache copy"))
    with torch.no_grad():
        restore()
        expected = dec.step(token, position)
        restore()
        got = gm(*args)
        restore()
    got_t = got[0] if isinstance(got, (list, tuple)) else got
    same = bool(torch.equal(got_t, expected))
    sec.figures.append(Figure.check("optimized graph's token equals eager", float(same), "",
                                    "== eager", same))
    sec.data.update(passes=rows, cache_tensor_bytes=cache_bytes,
                    bytes_counter="npugraph_passes.stats" if theirs else "bench.passes.copied_bytes")
    sec.bars["nodes after each pass"] = {k: float(v) for k, v in nodes.items()}
    try:
        stacked_kv_case(ctx, sec, PassManager.from_config(config), config)
    except Exception as exc:  # the Llama figures above still stand
        sec.figures.append(Figure.skip("stacked KV", f"failed: {fmt_exc(exc)}"))
    return sec
