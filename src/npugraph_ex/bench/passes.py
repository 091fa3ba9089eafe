"""(f) What the built-in passes do to the transformers Llama decode graph: ATen nodes before and
after each pass, and bytes copied into graph inputs per step before and after
input_inplace_pass. Target (issue 4): no whole-cache copy once input_inplace_pass has run."""

from __future__ import annotations

from typing import Any

import torch

from npugraph_ex.bench.backends import trace_aot
from npugraph_ex.bench.context import BenchContext, fmt_exc
from npugraph_ex.bench.report import Figure, Section
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
    return sec
