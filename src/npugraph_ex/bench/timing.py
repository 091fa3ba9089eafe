"""How every benchmark times: warm up, then the median of at least `runs` samples, each sample
the mean of `inner` calls (so a sample of a microsecond-scale call is above timer noise).
Device work is synchronised before each clock read."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from npugraph_ex.models import synchronize

MIN_RUNS = 20

_CLOCK: Callable[[], float] = time.perf_counter
CLOCK_NAME = "wall (perf_counter)"


def use_clock(device: torch.device, kind: str = "auto") -> str:
    """Choose the clock every timing reads. "cpu" is the calling thread's CPU time: on a CPU
    run with one intra-op thread it is the time the work took, without the time other
    processes of a shared machine took the core away. "auto" picks it exactly then, else wall
    time (always wall time for a GPU, whose work the host thread only waits for)."""
    global _CLOCK, CLOCK_NAME
    if kind not in ("auto", "cpu", "wall"):
        raise ValueError(f"clock={kind!r} is not allowed: use auto, cpu or wall")
    cpu_ok = device.type == "cpu" and torch.get_num_threads() == 1
    if kind == "cpu" and not cpu_ok:
        raise ValueError("clock='cpu' needs a CPU run with one intra-op thread (--threads 1)")
    if kind == "cpu" or (kind == "auto" and cpu_ok):
        _CLOCK, CLOCK_NAME = time.thread_time, "thread CPU time (thread_time)"
    else:
        _CLOCK, CLOCK_NAME = time.perf_counter, "wall (perf_counter)"
    return CLOCK_NAME


def clock() -> float:
    return _CLOCK()


def clock_is_cpu_time() -> bool:
    return _CLOCK is time.thread_time


@dataclass(frozen=True)
class Timing:
    """Seconds per call: median, 10th and 90th percentile over `runs` samples."""

    median: float
    p10: float
    p90: float
    runs: int
    inner: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def measure(
    fn: Callable[[], object],
    *,
    device: torch.device,
    runs: int = MIN_RUNS,
    warmup: int = 5,
    inner: int = 1,
) -> Timing:
    runs = max(runs, MIN_RUNS)
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples: list[float] = []
    clock = _CLOCK
    for _ in range(runs):
        start = clock()
        for _ in range(inner):
            fn()
        synchronize(device)
        samples.append((clock() - start) / inner)
    samples.sort()
    return Timing(
        median=statistics.median(samples),
        p10=samples[int(0.1 * (len(samples) - 1))],
        p90=samples[int(0.9 * (len(samples) - 1))],
        runs=runs,
        inner=inner,
    )


def inner_for(fn: Callable[[], object], device: torch.device, target_s: float = 2e-3) -> int:
    """Calls per sample so that one sample lasts about `target_s`."""
    synchronize(device)
    start = _CLOCK()
    fn()
    synchronize(device)
    once = max(_CLOCK() - start, 1e-7)
    return max(1, min(1000, int(target_s / once)))


def measure_interleaved(
    fns: dict[str, Callable[[], object]],
    *,
    device: torch.device,
    runs: int = MIN_RUNS,
    warmup: int = 5,
    target_s: float = 2e-3,
    setup: Callable[[], None] | None = None,
    max_inner: int = 1000,
) -> dict[str, Timing]:
    """Time several functions in rounds (one sample of each per round), so that a machine whose
    load changes over the run slows all of them alike and their ratios stay fair. Each sample
    starts with one untimed call, so no function pays for the caches the others evicted.
    `setup` (untimed) runs before every sample and warm call: it restores state the functions
    move on, such as a KV cache's write position; `max_inner` bounds the calls per sample."""
    runs = max(runs, MIN_RUNS)
    prepare = setup or (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            prepare()
            fn()
    inner = {}
    for name, fn in fns.items():
        prepare()
        inner[name] = min(max_inner, inner_for(fn, device, target_s))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    clock = _CLOCK
    synchronize(device)
    for _ in range(runs):
        for name, fn in fns.items():
            n = inner[name]
            prepare()
            fn()  # untimed: each sample starts with this function's code and data in cache
            prepare()
            synchronize(device)
            start = clock()
            for _ in range(n):
                fn()
            synchronize(device)
            samples[name].append((clock() - start) / n)
    result = {}
    for name, values in samples.items():
        values.sort()
        result[name] = Timing(
            median=statistics.median(values),
            p10=values[int(0.1 * (len(values) - 1))],
            p90=values[int(0.9 * (len(values) - 1))],
            runs=runs,
            inner=inner[name],
        )
    return result


def measure_states(
    fns: dict[str, Callable[[], object]],
    states: dict[str, Callable[[], contextlib.AbstractContextManager[object]]],
    *,
    device: torch.device,
    runs: int = MIN_RUNS,
    warmup: int = 5,
    target_s: float = 2e-3,
) -> dict[str, dict[str, Timing]]:
    """Like `measure_interleaved`, with each round also cycling through `states` (context
    managers entered outside the timed region), so that a state's effect is measured against
    the others in the same stretch of time: result[state][fn]."""
    runs = max(runs, MIN_RUNS)
    inner: dict[str, int] = {}
    for state in states.values():
        with state():
            for name, fn in fns.items():
                for _ in range(warmup):
                    fn()
                inner[name] = max(inner.get(name, 1), inner_for(fn, device, target_s))
    samples: dict[str, dict[str, list[float]]] = {s: {n: [] for n in fns} for s in states}
    for _ in range(runs):
        for state_name, state in states.items():
            with state():
                synchronize(device)
                for name, fn in fns.items():
                    n = inner[name]
                    fn()  # untimed: each sample starts with this function's code and data in cache
                    synchronize(device)
                    start = _CLOCK()
                    for _ in range(n):
                        fn()
                    synchronize(device)
                    samples[state_name][name].append((_CLOCK() - start) / n)
    return {s: {n: _timing(v, runs, inner[n]) for n, v in by_fn.items()}
            for s, by_fn in samples.items()}


def _timing(values: list[float], runs: int, inner: int) -> Timing:
    values = sorted(values)
    return Timing(median=statistics.median(values), p10=values[int(0.1 * (len(values) - 1))],
                  p90=values[int(0.9 * (len(values) - 1))], runs=runs, inner=inner)
