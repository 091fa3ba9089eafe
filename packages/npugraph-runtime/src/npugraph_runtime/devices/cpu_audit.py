"""Per-op audit of a CPU capture: how long each op's replay kernel takes against the eager op on
the same tensors. A replay should do no more work than eager per op; this finds the ops where it
does (a kernel that computes and then copies, an out= overload that copies twice)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from npugraph_runtime import _compat
from npugraph_runtime.devices.cpu import CpuGraph
from npugraph_runtime.devices.cpu_candidates import Kind, preferred
from npugraph_runtime.devices.cpu_replay import _Resolver
from npugraph_runtime.errors import CaptureError
from npugraph_runtime.schema import overload_name

# kernels that re-issue a functional op in another form: the ones an audit compares with eager
_REWRITTEN = frozenset({Kind.COPY, Kind.COPY_INTO, Kind.OUT_PUBLIC, Kind.OUT_OVERLOAD})


@dataclass(frozen=True)
class OpTiming:
    """One recorded op: its ATen name, the replay's kernel, and seconds per call of the replay's
    lines for it and of the eager op (which allocates its result) on the same tensors."""

    index: int
    op: str
    kernel: str
    replay_s: float
    eager_s: float

    @property
    def ratio(self) -> float:
        return self.replay_s / self.eager_s if self.eager_s > 0 else float("inf")


def _time(fn: Callable[[], object], clock: Callable[[], float], rounds: int, min_s: float) -> float:
    fn()
    inner = 1
    while True:  # enough calls per sample to be well above the clock's resolution
        start = clock()
        for _ in range(inner):
            fn()
        took = clock() - start
        if took >= min_s or inner >= 1024:
            break
        inner *= 4
    samples = [took / inner]
    for _ in range(rounds - 1):
        start = clock()
        for _ in range(inner):
            fn()
        samples.append((clock() - start) / inner)
    return statistics.median(samples)


def _kernel_name(step: Any, kind: Kind) -> str:
    """The kind of step, or the candidate that names the kernel more closely (gather_rows is
    an out= call of another op)."""
    if kind is Kind.OUT_PUBLIC and step.candidates:
        return preferred(step.candidates).label or kind.value
    return kind.value


def audit_kernels(
    graph: CpuGraph,
    *,
    rounds: int = 7,
    clock: Callable[[], float] = time.perf_counter,
    min_sample_s: float = 2e-4,
) -> list[OpTiming]:
    """Time every op whose replay kernel differs from the op itself. Running it replays parts of
    the graph, so the graph's buffers hold arbitrary values afterwards (replay it again, from
    fresh inputs, before reading its outputs)."""
    fn = getattr(graph, "_replay", None)
    ops = getattr(fn, "__ops__", None)
    if ops is None:
        raise CaptureError("audit_kernels() needs a captured cpu graph: capture it first")
    per_op, lines, namespace = ops
    res = _Resolver(graph._tensors)
    guard = _compat.inference_mode_guard()
    result: list[OpTiming] = []
    for i, (step, kind, first) in enumerate(per_op):
        if kind not in _REWRITTEN:
            continue
        last = per_op[i + 1][2] if i + 1 < len(per_op) else len(lines)
        body = "\n".join(f"        {line}" for line in lines[first:last])
        scope: dict[str, Any] = dict(namespace)
        exec(compile(f"def one():\n    with inference_mode(True):\n{body}\n", "<audit>", "exec"), scope)
        eager_op = partial(
            _compat.op_entry(step.func),
            *[res.value(a) for a in step.args],
            **{k: res.value(v) for k, v in step.kwargs.items()},
        )

        def eager(op: Callable[[], object] = eager_op) -> None:
            with guard(True):
                op()

        replay_s = _time(scope["one"], clock, rounds, min_sample_s)
        eager_s = _time(eager, clock, rounds, min_sample_s)
        result.append(OpTiming(i, overload_name(step.func), _kernel_name(step, kind), replay_s,
                               eager_s))
    return result
