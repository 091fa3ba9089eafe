"""deadlock_check: the multi-stream task graph of a compiled graph, checked for what hangs a
device graph.

The tasks are the graph's nodes after stream lowering, each on its stream (``meta["stream_label"]``,
None = the capture stream), in graph order per stream. Event tasks pair by tag: every
``npugraph_ex.event_wait(tag)`` waits for the ``event_record(tag)`` tasks. Reported:

* wait cycles: streams that wait for each other's records (none of them can go on);
* waits on an event that no task of the graph records (the wait never completes on a device);
* communication tasks (``_c10d_functional`` ops) that may run at the same time on different
  streams and together need more cores than the device has (each needs ``meta["core_demand"]``,
  default 1) -- concurrent collectives that each wait for all their cores deadlock.

The JSON report goes to the debug folder (TORCH_COMPILE_DEBUG) or else the data dump folder;
"No deadlock risks detected." is logged when clean, a DeadlockRiskWarning names the nodes when
not. The check reads the graph as captured (the lowering is deterministic), not the device's
task dump."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.fx

from npugraph_backend.logs import log

CLEAN = "No deadlock risks detected."


class DeadlockRiskWarning(UserWarning):
    """deadlock_check found a risk in a multi-stream graph (the message names the nodes)."""


@dataclass
class Task:
    name: str
    stream: str | None
    kind: str  # "record", "wait", "comm" or "op"
    tag: str | None = None
    demand: int = 0


@dataclass
class Report:
    graph: str
    total_cores: int
    streams: dict[str, list[str]] = field(default_factory=dict)
    wait_cycles: list[list[str]] = field(default_factory=list)
    unrecorded_waits: list[str] = field(default_factory=list)
    comm_conflicts: list[dict[str, object]] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.wait_cycles or self.unrecorded_waits or self.comm_conflicts)


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    return str(getattr(target, "__name__", target)) if node.op == "call_function" else ""


def tasks_of(gm: torch.fx.GraphModule) -> list[Task]:
    """The tasks of a lowered graph, in graph order."""
    tasks = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        stream = node.meta.get("stream_label")
        target = node.target
        namespace = getattr(target, "namespace", "")
        op = _op_name(node).split(".")[0]
        if namespace == "npugraph_ex" and op in ("event_record", "event_wait"):
            kind = "record" if op == "event_record" else "wait"
            tasks.append(Task(node.name, stream, kind, str(node.args[0])))
        elif namespace == "_c10d_functional" and op != "wait_tensor":
            tasks.append(Task(node.name, stream, "comm", demand=int(node.meta.get("core_demand", 1))))
        else:
            tasks.append(Task(node.name, stream, "op"))
    return tasks


def check(tasks: Sequence[Task], total_cores: int, graph: str = "") -> Report:
    """Analyse ``tasks`` (graph order; per stream, that is the stream's order)."""
    report = Report(graph, total_cores)
    preds: list[set[int]] = [set() for _ in tasks]
    last: dict[str | None, int] = {}
    records: dict[str, list[int]] = {}
    for i, t in enumerate(tasks):
        report.streams.setdefault(str(t.stream), []).append(t.name)
        if t.stream in last:
            preds[i].add(last[t.stream])
        last[t.stream] = i
        if t.kind == "record" and t.tag is not None:
            records.setdefault(t.tag, []).append(i)
    for i, t in enumerate(tasks):
        if t.kind == "wait" and t.tag is not None:
            found = records.get(t.tag)
            if not found:
                report.unrecorded_waits.append(t.name)
            else:
                preds[i].update(found)
    # Kahn's order; what is left sits on a wait cycle (or after one)
    remaining = [len(p) for p in preds]
    succs: list[list[int]] = [[] for _ in tasks]
    for i, p in enumerate(preds):
        for j in p:
            succs[j].append(i)
    ready = [i for i, n in enumerate(remaining) if n == 0]
    order = []
    while ready:
        i = ready.pop()
        order.append(i)
        for j in succs[i]:
            remaining[j] -= 1
            if remaining[j] == 0:
                ready.append(j)
    stuck = {i for i, n in enumerate(remaining) if n > 0}
    if stuck:
        report.wait_cycles = _cycles(stuck, preds, tasks)
    # happens-before as bit sets of ancestors, over the tasks not stuck
    before = [0] * len(tasks)
    for i in order:
        for j in preds[i]:
            before[i] |= before[j] | (1 << j)
    comms = [i for i in order if tasks[i].kind == "comm" and tasks[i].demand > 0]
    for a_pos, a in enumerate(comms):
        for b in comms[a_pos + 1:]:
            ta, tb = tasks[a], tasks[b]
            if ta.stream == tb.stream or before[a] >> b & 1 or before[b] >> a & 1:
                continue
            if ta.demand + tb.demand > total_cores:
                report.comm_conflicts.append({
                    "tasks": [ta.name, tb.name], "streams": [str(ta.stream), str(tb.stream)],
                    "demand": ta.demand + tb.demand, "total": total_cores,
                })
    return report


def _cycles(stuck: set[int], preds: list[set[int]], tasks: Sequence[Task]) -> list[list[str]]:
    """One cycle through each group of stuck tasks, by walking predecessors."""
    cycles: list[list[str]] = []
    seen: set[int] = set()
    for start in sorted(stuck):
        if start in seen:
            continue
        path: list[int] = []
        on_path: dict[int, int] = {}
        i = start
        while i not in on_path and i not in seen:
            on_path[i] = len(path)
            path.append(i)
            i = min(j for j in preds[i] if j in stuck)
        seen.update(path)
        if i in on_path:
            cycle = path[on_path[i]:]
            cycles.append([tasks[j].name for j in reversed(cycle)])
    return cycles


def _total_cores(device: torch.device) -> int:
    from npugraph_runtime import max_core_num

    try:
        cores = max_core_num(device)[1] or max_core_num(device)[0]
    except Exception:  # a device limit_core_num cannot query: demands are compared with 0
        return 0
    return cores


def run(gm: torch.fx.GraphModule, graph: str, device: torch.device, folder: str) -> Report:
    """Check ``gm``, write ``<folder>/<graph>_deadlock_check.json``, log or warn the result."""
    report = check(tasks_of(gm), _total_cores(device), graph)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{graph}_deadlock_check.json")
    payload: dict[str, Any] = asdict(report)
    payload["clean"] = report.clean
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
    if report.clean:
        log.info("%s: %s (report: %s)", graph, CLEAN, path)
        return report
    parts = []
    if report.wait_cycles:
        parts.append("wait cycles " + "; ".join(" -> ".join(c) for c in report.wait_cycles))
    if report.unrecorded_waits:
        parts.append("waits on events never recorded: " + ", ".join(report.unrecorded_waits))
    for c in report.comm_conflicts:
        parts.append(f"concurrent communication {c['tasks'][0]} ({c['streams'][0]}) and "  # type: ignore[index]
                     f"{c['tasks'][1]} ({c['streams'][1]}) need {c['demand']} cores > {c['total']}")  # type: ignore[index]
    message = f"npugraph_ex deadlock_check: {graph} has deadlock risks: " + "; ".join(parts) + (
        f" (report: {path})"
    )
    log.warning("%s", message)
    warnings.warn(message, DeadlockRiskWarning, stacklevel=3)
    return report
