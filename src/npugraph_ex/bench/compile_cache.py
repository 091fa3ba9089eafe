"""(d) Compile time and warm-start time, with and without ``npugraph_ex.inference.cache_compile``,
each in a fresh subprocess.

The workload: one greedy decode step of a transformers Llama with its StaticCache (the built-in
transformer without transformers), as a module method: the tiny model, and on full runs the
medium one (hidden 768, 12 layers, vocab 32000; issue 13). "First call" = from compiling to the first output (dynamo, AOT, passes and capture; or
loading the cache entry and capturing). Runs: without cache_compile twice (cold, then warm with
torch's own caches), with it twice (cold: compiles and writes; warm: loads). Target (issue 7):
warm start with cache_compile <= 0.1x the cold compile.

On full runs the cold compile without cache and the warm start are also run with ``gc.freeze()``
called after building the model (what servers do once the model is loaded; see the README): a
warm start then skips the full collection over the model's and transformers' objects (~0.1 s)
that otherwise falls into it. Those figures and their ratio say "gc.freeze()" in their names;
the plain figures never freeze."""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from npugraph_ex.bench.context import BenchContext, fmt_exc
from npugraph_ex.bench.report import Figure, Section
from npugraph_ex.bench.timing import clock_is_cpu_time
from npugraph_ex.models import decoder_logits

TARGET = 0.1
FROZEN = "gc.freeze()"
SIZES = ("tiny", "medium")
CHILD_TIMEOUT_S = 300


class DecodeStep(nn.Module):
    """One greedy decode step of a causal LM with its static KV cache, as a module method (what
    cache_compile takes)."""

    def __init__(self, family: str, lm: nn.Module, cache: Any) -> None:
        super().__init__()
        self.family = family
        self.lm = lm
        self.cache = cache

    def forward(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        logits = decoder_logits(self.family, self.lm, token, position, self.cache)
        out: torch.Tensor = logits[:, -1, :].argmax(dim=-1, keepdim=True)
        return out


def _child(mode: str, cache_dir: str, device: str, size: str = "tiny",
           gc_freeze: bool = False) -> dict[str, Any]:
    from npugraph_ex.bench.backends import compile_with
    from npugraph_ex.models import build_decoder, synchronize

    torch.set_num_threads(1)
    dev = torch.device(device)
    dec = build_decoder("llama", size, dev)
    module = DecodeStep(dec.family, dec.model, dec.cache).eval()
    token = dec.prefill(dec.prompt(8))
    position = dec.position(8)
    restore = dec.checkpoint()  # each call below decodes from the same cache state
    with torch.no_grad():
        expected = module(token, position)
    restore()
    if gc_freeze:
        gc.freeze()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start, start_cpu = time.perf_counter(), time.process_time()
        if mode == "plain":
            fn: Any = compile_with(module, "ours")
        else:
            from npugraph_ex.inference import cache_compile

            fn = cache_compile(module.forward, dynamic=False, cache_dir=cache_dir)
        with torch.no_grad():
            out = fn(token, position)
        synchronize(dev)
        first, first_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    restore()
    start = time.perf_counter()
    with torch.no_grad():
        again = fn(token, position)
    synchronize(dev)
    second = time.perf_counter() - start
    cache_warnings = sorted({str(w.message)[:300] for w in caught if "cache" in str(w.message).lower()})
    return {"first_call_s": first, "first_call_cpu_s": first_cpu, "second_call_s": second, "model": dec.family,
            "equal_eager": bool(torch.equal(out, expected) and torch.equal(again, expected)),
            "cache_warnings": cache_warnings}


def _spawn(mode: str, cache_dir: Path, inductor_dir: Path, device: torch.device,
           size: str = "tiny", gc_freeze: bool = False) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor_dir), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "npugraph_ex.bench.compile_cache", "--child", mode,
           "--cache-dir", str(cache_dir), "--device", str(device), "--size", size]
    if gc_freeze:
        cmd.append("--gc-freeze")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"took over {CHILD_TIMEOUT_S} s"}
    wall = time.perf_counter() - start
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            result: dict[str, Any] = json.loads(line)
            result["process_s"] = wall
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: {' | '.join(tail)[:400]}"}


def run(ctx: BenchContext) -> Section:
    sec = Section("d", "compile and warm-start time (fresh subprocesses)", bar_unit="s to first output")
    runs = [("no cache: cold", "plain", "a", False),
            ("no cache: warm (torch caches)", "plain", "a", False),
            ("cache_compile: cold", "cache", "b", False), ("cache_compile: warm", "cache", "b", False),
            (f"no cache: cold, {FROZEN}", "plain", "c", True),
            (f"cache_compile: warm, {FROZEN}", "cache", "b", True)]
    # tiny, and the medium Llama (hidden 768, 12 layers, vocab 32000) of issue 13 on full runs
    sizes = SIZES[:1] if ctx.quick else SIZES
    if ctx.quick:
        runs = runs[2:4]
    # On a CPU run timed by CPU time, so are these (the process's CPU time: the compile is
    # single-threaded Python; other processes of a shared machine do not count).
    metric = "first_call_cpu_s" if clock_is_cpu_time() else "first_call_s"
    sec.data["metric"] = metric
    results: dict[str, dict[str, Any]] = {}
    plan = [(size, *run_) for size in sizes for run_ in runs]
    with tempfile.TemporaryDirectory(prefix="npugraph-bench-") as tmp:
        root = Path(tmp)
        for size, label, mode, slot, freeze in ctx.steps(plan, desc="cold/warm processes"):
            results[f"{size}: {label}"] = _spawn(mode, root / f"cache-{size}",
                                                 root / f"inductor-{size}-{slot}", ctx.device, size,
                                                 freeze)
    for label, res in results.items():
        if "error" in res:
            sec.figures.append(Figure.skip(label, res["error"]))
        else:
            notes = [] if res["equal_eager"] else ["output differs from eager"]
            notes += res.get("cache_warnings", [])
            sec.figures.append(Figure(label, res[metric], "s", note="; ".join(notes)))
    sec.data["runs"] = results
    sec.bars["first output"] = {k: v[metric] for k, v in results.items() if "error" not in v}
    for size in sizes:
        cold_label = "no cache: cold" if f"{size}: no cache: cold" in results else "cache_compile: cold"
        _ratio(sec, results, size, "cache_compile: warm", cold_label, metric)
        if f"{size}: cache_compile: warm, {FROZEN}" in results:
            _ratio(sec, results, size, f"cache_compile: warm, {FROZEN}",
                   f"no cache: cold, {FROZEN}", metric)
    return sec


def _ratio(sec: Section, results: dict[str, dict[str, Any]], size: str, warm_label: str,
           cold_label: str, metric: str) -> None:
    cold = results.get(f"{size}: {cold_label}", {}).get(metric)
    warm = results.get(f"{size}: {warm_label}", {}).get(metric)
    name = f"{size}: {warm_label} / {cold_label}"
    if cold and warm is not None:
        ok = all(r.get("equal_eager") for k, r in results.items()
                 if k.startswith(f"{size}:") and "error" not in r)
        sec.figures.append(Figure.check(name, warm / cold, "x", f"<= {TARGET}x",
                                        warm / cold <= TARGET and ok))
    else:
        sec.figures.append(Figure.skip(name, "a run failed (see above)", f"<= {TARGET}x"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one child process of bench section (d)")
    p.add_argument("--child", choices=("plain", "cache"), required=True)
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", choices=SIZES, default="tiny")
    p.add_argument("--gc-freeze", action="store_true",
                   help="call gc.freeze() after building the model, before the timed part")
    args = p.parse_args(argv)
    try:
        result = _child(args.child, args.cache_dir, args.device, args.size, args.gc_freeze)
    except Exception as exc:
        print(fmt_exc(exc), file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
