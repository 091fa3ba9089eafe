"""(h) Per-op audit of the replay kernels: for each op of the captured Llama decode graph (our
backend's, after the passes) whose replay re-issues it in another form (out=, compute-and-copy,
``out.copy_(src)``), its replay lines against the eager op on the same tensors. Lists the worst
ops by time the replay spends over eager, summed per op and kernel. Target (issue 14): no op
kind slower than eager by more than 10% and 20 µs a step."""

from __future__ import annotations

import gc
from collections import defaultdict
from typing import Any

import torch

from npugraph_ex.bench.backends import OURS, compile_with, own_code
from npugraph_ex.bench.context import BenchContext, fmt_exc
from npugraph_ex.bench.report import Figure, Section
from npugraph_ex.bench.timing import clock
from npugraph_ex.models import build_decoder

WORST = 10
SLOWER = 1.10
SLACK_S = 20e-6


def _captured_cpu_graphs() -> list[Any]:
    from npugraph_runtime.devices.cpu import CpuGraph

    # type(), not isinstance(): gc also lists weak proxies, which isinstance() would dereference
    return [o for o in gc.get_objects() if type(o) is CpuGraph and o.recorded_ops() > 0]


def run(ctx: BenchContext) -> Section:
    sec = Section("h", "replay kernels vs eager ops", bar_unit="ms per step")
    if not ctx.on_cpu:
        sec.figures.append(Figure.skip("kernel audit", "the audit times the emulated CPU graph"))
        return sec
    try:
        from npugraph_runtime.devices.cpu_audit import audit_kernels
    except ImportError as exc:
        sec.figures.append(Figure.skip("kernel audit", fmt_exc(exc)))
        return sec
    size, batch = ("tiny", 8) if ctx.quick else ("medium", 8)
    label = f"llama-{size}-b{batch}"
    dec = build_decoder("llama", size, ctx.device, max_len=64, batch=batch)
    token = dec.prefill(dec.prompt(8))
    position = dec.position(8)
    restore = dec.checkpoint()
    torch.compiler.reset()
    before = {id(g) for g in _captured_cpu_graphs()}
    with torch.no_grad():
        step = compile_with(own_code(dec.step, "audit"), OURS)
        for _ in range(3):
            restore()
            step(token, position)
    graphs = [g for g in _captured_cpu_graphs() if id(g) not in before]
    if not graphs:
        sec.figures.append(Figure.skip(f"{label} kernel audit", "no cpu graph was captured"))
        return sec
    graph = max(graphs, key=lambda g: g.recorded_ops())
    rows = audit_kernels(graph, clock=clock, rounds=max(5, ctx.runs // 4))
    restore()
    torch.compiler.reset()
    per_kind: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        entry = per_kind[(r.op, r.kernel)]
        entry[0] += 1
        entry[1] += r.replay_s
        entry[2] += r.eager_s
    ranked = sorted(per_kind.items(), key=lambda kv: kv[1][2] - kv[1][1])
    replay_total = sum(r.replay_s for r in rows)
    eager_total = sum(r.eager_s for r in rows)
    sec.figures.append(Figure(f"{label}: audited ops", float(len(rows)), "",
                              note=f"of {graph.recorded_ops()} the replay issues"))
    sec.figures.append(Figure(f"{label}: audited ops, replay / eager", replay_total / eager_total,
                              "x", note=f"{replay_total * 1e3:.2f} ms against {eager_total * 1e3:.2f} ms"))
    bad = 0
    for (op, kernel), (n, replay_s, eager_s) in ranked[:WORST]:
        over = replay_s - eager_s
        slow = replay_s > SLOWER * eager_s and over > SLACK_S
        bad += slow
        sec.figures.append(Figure(f"{op} [{kernel}] x{int(n)}", replay_s / eager_s, "x",
                                  status="MISS" if slow else "INFO",
                                  note=f"replay {replay_s * 1e6:.0f} µs, eager {eager_s * 1e6:.0f} µs"))
    slow_kinds = [k for k, (n, rs, es) in per_kind.items() if rs > SLOWER * es and rs - es > SLACK_S]
    sec.figures.append(Figure.check(f"{label}: op kinds slower than eager", float(len(slow_kinds)), "",
                                    f"0 (> {SLOWER:.2f}x and > {SLACK_S * 1e6:.0f} µs)",
                                    not slow_kinds, note=", ".join(f"{o} [{k}]" for o, k in slow_kinds)))
    sec.data[label] = {
        "ops": [dict(index=r.index, op=r.op, kernel=r.kernel, replay_s=r.replay_s,
                     eager_s=r.eager_s) for r in rows],
    }
    sec.bars[f"{label} audited ops"] = {"replay": replay_total * 1e3, "eager": eager_total * 1e3}
    return sec
