"""`npugraph-ex bench`: the benchmark suite, side by side in one process.

Sections (select with ``--only a,c``): (a) replay-path host overhead, (b) runtime replay vs the
FX GraphModule vs eager, (c) decode-step latency per compiler, (d) compile and warm-start time
with and without cache_compile, (e) pool sharing, (f) the passes' effect, (g) overhead with
logging disabled and no profiler, (h) each replay kernel against the eager op, (i) a 2-rank
tensor-parallel decode step on the CPU, (k) a continuous-batching decode loop (capture sizes
with padding), (m) graphs updating an input that is new on every call
in place, (s) two matmul branches on two streams vs one. Writes ``bench.json`` and ``bench.png`` into ``--out``."""

from __future__ import annotations

import importlib
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from npugraph_ex.arguments import bench_parser as parser  # torch-free: the CLI parses first
from npugraph_ex.bench.context import BenchContext, fmt_exc
from npugraph_ex.bench.report import Section, environment, plot, print_table, write_json
from npugraph_ex.bench.timing import use_clock
from npugraph_ex.models import best_device

SECTIONS: dict[str, tuple[str, str]] = {
    "a": ("npugraph_ex.bench.overhead", "run_overhead"),
    "b": ("npugraph_ex.bench.replay", "run"),
    "c": ("npugraph_ex.bench.decode", "run"),
    "d": ("npugraph_ex.bench.compile_cache", "run"),
    "e": ("npugraph_ex.bench.pools", "run"),
    "f": ("npugraph_ex.bench.passes", "run"),
    "g": ("npugraph_ex.bench.overhead", "run_quiet"),
    "h": ("npugraph_ex.bench.kernels", "run"),
    "i": ("npugraph_ex.bench.tp_decode", "run"),
    "k": ("npugraph_ex.bench.batching", "run"),
    "m": ("npugraph_ex.bench.inplace", "run"),
    "s": ("npugraph_ex.bench.streams", "run"),
}
TITLES = {
    "a": "replay-path host overhead",
    "b": "replay vs GraphModule vs eager",
    "c": "decode-step latency per compiler",
    "d": "compile and warm-start time, cache_compile",
    "e": "pool sharing across 8 batch sizes",
    "f": "the passes' effect on the Llama decode graph",
    "g": "overhead with logging disabled and no profiler",
    "h": "replay kernels vs eager ops",
    "i": "2-rank tensor-parallel decode step (CPU, gloo)",
    "k": "continuous batching: capture sizes with padding",
    "m": "inputs updated in place, new on every call",
    "s": "two matmul branches: two streams vs one",
}


def selected(only: str) -> list[str]:
    if not only:
        return list(SECTIONS)
    keys = [k.strip().lower() for k in only.split(",") if k.strip()]
    unknown = [k for k in keys if k not in SECTIONS]
    if unknown:
        raise SystemExit(f"--only {only!r}: unknown section(s) {', '.join(unknown)}; "
                         f"use any of {','.join(SECTIONS)}")
    return keys


def run_section(ctx: BenchContext, key: str) -> Section:
    module, func = SECTIONS[key]
    start = time.perf_counter()
    try:
        fn: Callable[[BenchContext], Section] = getattr(importlib.import_module(module), func)
        sec = fn(ctx)
    except Exception as exc:  # one broken section must not lose the others' figures
        sec = Section(key, TITLES[key], error=fmt_exc(exc))
        sec.data["traceback"] = traceback.format_exc()
    sec.seconds = time.perf_counter() - start
    return sec


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    keys = selected(args.only)
    device = torch.device(args.device) if args.device else best_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device!r}: no CUDA device here (torch {torch.__version__})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = args.runs if args.runs is not None else (20 if args.quick else 30)
    if runs < 20:
        raise SystemExit(f"--runs {runs}: the suite reports medians of at least 20 runs")
    threads = args.threads if args.threads is not None else (1 if device.type == "cpu" else 0)
    if threads > 0:
        torch.set_num_threads(threads)
    clock_name = use_clock(device, args.clock)
    deadline = time.monotonic() + args.budget if args.budget else None
    ctx = BenchContext(deadline=deadline, device=device, out=out, quick=args.quick, runs=runs,
                       inductor_budget_s=args.inductor_budget, progress=not args.no_progress,
                       decode_cases=tuple(c.strip() for c in args.decode_cases.split(",") if c.strip()))
    env = environment(device)
    env["clock"] = clock_name
    print(f"npugraph-ex bench on {device} ({env['device_name']}), torch {env['torch']}, "
          f"{env['cores']} cores, {torch.get_num_threads()} thread(s), clock {clock_name}, sections {','.join(keys)}{' (quick)' if args.quick else ''}",
          flush=True)
    sections: list[Section] = []
    started = time.perf_counter()
    ctx.save_partial = lambda sec: write_json(out / "bench.json", env, [*sections, sec])
    for key in keys:
        elapsed = time.perf_counter() - started
        if args.budget and elapsed > args.budget:
            sec = Section(key, TITLES[key], error=f"not run: the --budget of {args.budget:.0f} s "
                                                  f"was spent after {elapsed:.0f} s")
        else:
            print(f"-- ({key}) {TITLES[key]} ...", flush=True)
            sec = run_section(ctx, key)
        sections.append(sec)
        print_table([sec])
        env["total_seconds"] = round(time.perf_counter() - started, 1)
        write_json(out / "bench.json", env, sections)  # after each section: a killed run keeps its figures
    drew = plot(out / "bench.png", sections, f"npugraph-ex bench: {device}, torch {env['torch']}")
    print("\n==== summary")
    print_table(sections)
    misses = [f"({s.key}) {f.name}" for s in sections for f in s.figures if f.status == "MISS"]
    errors = [f"({s.key}) {s.error}" for s in sections if s.error]
    print(f"\n{len(misses)} target(s) missed" + (": " + "; ".join(misses) if misses else ""))
    if errors:
        print("sections that failed: " + "; ".join(errors))
    print(f"wrote {out / 'bench.json'}" + (f" and {out / 'bench.png'}" if drew else
                                          " (no PNG: matplotlib missing)")
          + f" in {env['total_seconds']} s")
    return 1 if errors else 0
