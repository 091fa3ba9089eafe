"""The compilers the benchmarks compare, behind one function, and what is needed to reach ours.

"ours" is the npugraph_ex backend, by its registered name as users write it, else by its
callable (a source tree on PYTHONPATH with no installed entry point)."""

from __future__ import annotations

import contextlib
import signal
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from npugraph_ex.bench._compat import aot_graph_backend, dynamo_counters

OURS = "ours"
CUDA_ONLY = ("cudagraphs", "reduce-overhead")


def ours_backend() -> str | Callable[..., Any] | None:
    """backend="npugraph_ex" as users write it when the entry point is registered, else the
    backend callable itself (a source tree on PYTHONPATH without the generated entry point)."""
    if "npugraph_ex" in torch.compiler.list_backends():
        return "npugraph_ex"
    try:
        from npugraph_backend import npugraph_ex_backend
    except ImportError:
        return None
    return npugraph_ex_backend


def ours_missing_reason() -> str:
    return ("the npugraph_ex backend is not available (npugraph_backend.npugraph_ex_backend "
            "does not import and no 'npugraph_ex' entry point is registered)")


def compile_with(
    fn: Callable[..., Any], backend: str, *, options: dict[str, Any] | None = None,
    dynamic: bool | None = False,
) -> Callable[..., Any]:
    """`fn` compiled by `backend` (eager returns it unchanged), fullgraph=True."""
    if backend == "eager":
        return fn
    if backend == "reduce-overhead":
        return torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=dynamic)
    if backend == OURS:
        ours = ours_backend()
        if ours is None:
            raise RuntimeError(ours_missing_reason())
        return torch.compile(fn, backend=ours, fullgraph=True, dynamic=dynamic, options=options)
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)


def captures(since: dict[str, int] | None = None) -> int:
    """Distinct captures alive now of the graphs compiled after the snapshot `since`, from the
    runtime's counters (captured_<graph name>, names unique in a process)."""
    before = since or {}
    counts = dynamo_counters().get("npugraph_ex", {})
    return sum(int(v) for k, v in counts.items() if k.startswith("captured_") and k not in before)


def counter_snapshot() -> dict[str, int]:
    return {k: int(v) for k, v in dynamo_counters().get("npugraph_ex", {}).items()}


class BenchTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise BenchTimeout in the main thread after `seconds` (no limit off the main thread or
    where SIGALRM does not exist)."""
    usable = (seconds > 0 and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise BenchTimeout(f"gave up after {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Traced:
    """The ATen inference graph that AOTAutograd makes of a function (what our backend compiles),
    with the real tensors it takes: ``gm(*args)`` runs it directly."""

    def __init__(self, gm: torch.fx.GraphModule, args: list[Any], outputs: Any) -> None:
        self.gm = gm
        self.args = args
        self.outputs = outputs

    def ops(self) -> int:
        return sum(1 for n in self.gm.graph.nodes if n.op == "call_function")

    def __call__(self) -> Any:
        return self.gm(*self.args)


def trace_aot(fn: Callable[..., Any], *args: Any) -> Traced:
    """Run ``fn(*args)`` once through dynamo + AOTAutograd and keep the ATen graph and the
    real arguments dynamo passed to it (parameters, buffers and caches included)."""
    seen: dict[str, Any] = {}

    def fw(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        seen["gm"] = gm
        seen["n"] = len(example_inputs)
        return gm

    aot = aot_graph_backend(fw)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        seen["args"] = list(example_inputs)
        return aot(gm, example_inputs)  # type: ignore[no-any-return]

    torch.compiler.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        outputs = compiled(*args)
    torch.compiler.reset()
    if "gm" not in seen or seen["n"] != len(seen["args"]):
        raise RuntimeError("AOTAutograd lifted extra inputs: the ATen graph cannot be run directly")
    return Traced(seen["gm"], seen["args"], outputs)


def own_code(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """A copy of function `fn` with a code object of its own. dynamo caches compiled entries per
    code object and tries each entry's guards in turn, so compiling one function with several
    backends side by side would make every call pay for the other backends' guards; with a code
    object each, every compiled function has exactly one entry."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{tag}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy
