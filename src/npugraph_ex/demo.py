"""`npugraph-ex demo`: greedy decoding with a small Llama, eager against npugraph_ex.

Builds a Llama from a transformers config (random weights, nothing downloaded; without
transformers, a built-in tiny transformer, said so), decodes N tokens eagerly, with aot_eager and
with backend="npugraph_ex" (StaticCache, fullgraph=True), and shows: tokens identical (exit 1 if
not), number of captures, per-token latency of each, the speedup, and the memory the graphs
hold. Writes demo.json and demo.png into --out."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from npugraph_ex.arguments import demo_parser as parser  # torch-free: the CLI parses first
from npugraph_ex.bench._compat import dynamo_counters
from npugraph_ex.bench.backends import (
    OURS,
    captures,
    compile_with,
    counter_snapshot,
    ours_backend,
    ours_missing_reason,
)
from npugraph_ex.bench.context import BenchContext, fmt_exc
from npugraph_ex.bench.report import environment
from npugraph_ex.bench.timing import clock, use_clock
from npugraph_ex.models import best_device, build_decoder, synchronize

PROMPT = 8
MIN_TOKENS = 4  # a first token, a step that compiles and captures, and steady steps after it


class _Pool:
    """The memory our graphs hold: a pool of ours given to the backend (use_graph_pool), read
    with npugraph_runtime.pool_bytes; else, on CUDA, the allocator's growth."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.handle: Any = None
        self.how = "not measured"
        self.start = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        try:
            import npugraph_runtime as ngr

            self.handle = ngr.graph_pool_handle(device)
            self.how = "npugraph_runtime.pool_bytes"
        except (ImportError, AttributeError, RuntimeError):
            if device.type == "cuda":
                self.how = "CUDA allocator growth"

    def options(self) -> dict[str, Any]:
        return {"use_graph_pool": self.handle} if self.handle is not None else {}

    def held(self) -> int | None:
        if self.handle is not None:
            import npugraph_runtime as ngr

            return int(ngr.pool_bytes(self.handle))
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device) - self.start)
        return None


def _phase(text: str) -> None:
    print(text, flush=True)


def _setup_state() -> tuple[int, int]:
    """Dynamo's count of compiled graphs and our count of captures made (a new key, a held
    output, a recapture): a step that changes either compiled or captured. Per-call counts (an
    eager call, an input copied) are not setup: a step that only moves them is a steady step."""
    counts = dynamo_counters()
    made = sum(int(v) for k, v in counts.get("npugraph_ex", {}).items()
               if k.startswith(("capture_due_to_", "recapture_due_to_")))
    return int(counts.get("stats", {}).get("unique_graphs", 0)), made


def steady_start(setup: Sequence[bool]) -> int:
    """The index of the first step after the last one that compiled or captured (0: none did)."""
    return max((i + 1 for i, busy in enumerate(setup) if busy), default=0)


def decode(ctx: BenchContext, dec: Any, name: str, prompt: torch.Tensor, n: int,
           options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Greedy-decode n tokens with `name`; per-step seconds, which steps compiled or captured
    (from the counters, step by step), and the tokens. The steps up to the first quiet one
    (compile, warm-up, captures) are a phase of their own, with a line before and after, so that
    the progress bar of the steady steps shows a real rate and ETA. The per-token latency is the
    median of the steps after the last one that compiled or captured."""
    torch.compiler.reset()
    start = time.perf_counter()
    step = compile_with(dec.step, name, options=options)
    label = "npugraph_ex" if name == OURS else name
    first = {"eager": "first step", "aot_eager": "compile"}.get(name, "compile and capture")
    with torch.no_grad():
        token = dec.prefill(prompt)
        tokens = [int(t) for t in token.flatten().tolist()]
        times: list[float] = []
        setup: list[bool] = []

        def run(i: int) -> None:
            nonlocal token
            before = _setup_state()
            t0 = clock()
            token = step(token, dec.position(PROMPT + i))
            synchronize(dec.device)
            times.append(clock() - t0)
            setup.append(_setup_state() != before)
            tokens.extend(int(t) for t in token.flatten().tolist())

        _phase(f"{label}: {first} ...")
        t0 = time.perf_counter()
        run(0)
        while setup[-1] and len(times) < n - 1:  # until a step neither compiles nor captures
            run(len(times))
        rest = range(len(times), n - 1)
        _phase(f"{label}: {first} done in {time.perf_counter() - t0:.1f} s; "
               f"decoding {len(rest)} more tokens ...")
        t0 = time.perf_counter()
        for i in ctx.steps(rest, desc=f"{label:>11}", total=len(rest)):
            run(i)
    busy = steady_start(setup)
    setup_steps = [i + 1 for i, b in enumerate(setup) if b]
    # a later capture (the one a held output asks for) can come after a quiet step: say where
    where = (f"steps that compiled or captured: {', '.join(map(str, setup_steps))}; steady "
             f"from step {busy + 1}" if setup_steps else "no step compiled or captured")
    _phase(f"{label}: decoded in {time.perf_counter() - t0:.2f} s ({where})")
    steady = times[busy:] or times
    return {"tokens": tokens, "step_s": times, "setup_steps": setup_steps,
            "steady_from_step": busy + 1, "per_token_ms": statistics.median(steady) * 1e3,
            "first_steps_s": sum(times[:busy]), "total_s": time.perf_counter() - start}


def _device(spec: str) -> torch.device:
    """--device: cpu, cuda or npu (an index allowed), present on this machine."""
    kind = spec.split(":", 1)[0]
    if kind not in ("cpu", "cuda", "npu"):
        raise ValueError(f"--device {spec!r}: allowed: cpu, cuda or npu (e.g. cuda:1)")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {spec!r}: no CUDA device here (torch {torch.__version__})")
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the npu device type)
        except ImportError as exc:
            raise ValueError(f"--device {spec!r}: torch_npu does not import ({exc})") from exc
    return torch.device(spec)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    n = 8 if args.quick else args.tokens
    if args.tp != 1:
        from npugraph_ex.tp_demo import main as tp_main

        return tp_main(n, args.tp, args.out, args.threads)
    if n < MIN_TOKENS:
        print(f"--tokens {n}: give at least {MIN_TOKENS}", file=sys.stderr)
        return 2
    try:
        device = _device(args.device) if args.device else best_device()
    except ValueError as exc:
        print(f"npugraph-ex demo: {exc}", file=sys.stderr)
        return 2
    threads = args.threads if args.threads is not None else (1 if device.type == "cpu" else 0)
    if threads > 0:
        torch.set_num_threads(threads)
    clock_name = use_clock(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = BenchContext(device=device, out=out, quick=args.quick, progress=not args.no_progress)
    if ours_backend() is None:
        print(f"npugraph-ex demo: {ours_missing_reason()}", file=sys.stderr)
        return 2

    _phase(f"building the model (llama, {args.size}) on {device} ...")
    dec = build_decoder("llama", args.size, device, max_len=PROMPT + n + 8)
    what = f"{dec.family} ({args.size}, {dec.params / 1e6:.2f}M parameters, {dec.dtype})"
    env = environment(device)
    versions = f"torch {torch.__version__}" + (f", transformers {env['transformers']}"
                                              if env.get("transformers") else "")
    print(f"npugraph-ex demo on {device}: {versions}; {what}; "
          f"greedy decoding of {n} tokens after a {PROMPT}-token prompt")
    if dec.note:
        print(f"note: {dec.note}")
    prompt = dec.prompt(PROMPT)
    pool = _Pool(device)
    runs: dict[str, dict[str, Any]] = {}
    names = ("eager", OURS) if args.quick else ("eager", "aot_eager", OURS)
    for name in names:
        before = counter_snapshot()
        try:
            runs[name] = decode(ctx, dec, name, prompt, n, pool.options() if name == OURS else None)
        except Exception as exc:
            if name == OURS:
                print(f"npugraph_ex failed: {fmt_exc(exc)}", file=sys.stderr)
                return 1
            print(f"{name} skipped: {fmt_exc(exc)}")
            continue
        if name == OURS:
            runs[name]["captures"] = captures(before)
            runs[name]["graph_bytes"] = pool.held()
    torch.compiler.reset()

    eager, ours = runs["eager"], runs[OURS]
    same = eager["tokens"] == ours["tokens"]
    rows = [(name, r["per_token_ms"], eager["per_token_ms"] / r["per_token_ms"])
            for name, r in runs.items()]
    print(f"\ntokens identical to eager: {'yes' if same else 'NO'}")
    print(f"  eager: {eager['tokens']}")
    if not same:
        print(f"  ours:  {ours['tokens']}")
    print(f"captures: {ours['captures']}")
    memory = ours["graph_bytes"]
    size = (f"{memory / 2**20:.2f} MiB" if memory is not None and memory >= 2**20
            else f"{(memory or 0) / 2**10:.1f} KiB")
    print(f"memory held by the graphs: {size} ({pool.how})" if memory is not None
          else "memory held by the graphs: not measured")
    print(f"\nper-token latency (median of the steps after the last one that compiled or "
          f"captured; clock: {clock_name}):")
    for name, ms, speedup in rows:
        label = "npugraph_ex" if name == OURS else name
        r = runs[name]
        steady = len(r["step_s"]) - r["steady_from_step"] + 1
        where = (f"steps {r['steady_from_step']}-{len(r['step_s'])}" if steady > 0
                 else "no steady step: all steps, give more --tokens")
        print(f"  {label:<12} {ms:9.3f} ms   {speedup:5.2f}x eager   ({where})")
    doc = {
        "environment": {**env, "clock": clock_name},
        "model": {"family": dec.family, "size": args.size, "params": dec.params,
                  "dtype": str(dec.dtype), "note": dec.note},
        "prompt_tokens": PROMPT, "tokens": n, "tokens_identical": same,
        "captures": ours["captures"], "graph_bytes": memory, "graph_bytes_from": pool.how,
        "runs": {("npugraph_ex" if k == OURS else k): v for k, v in runs.items()},
        "speedup_vs_eager": {("npugraph_ex" if k == OURS else k): s for k, _, s in rows},
    }
    (out / "demo.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    drew = _plot(out / "demo.png", runs, f"{what} on {device}")
    print(f"\nwrote {out / 'demo.json'}" + (f" and {out / 'demo.png'}" if drew else ""))
    if not drew:
        print("demo.png skipped: matplotlib is not installed (pip install matplotlib, or install "
              "with requirements/local.txt as the README says)")
    return 0 if same else 1


def _plot(path: Path, runs: dict[str, dict[str, Any]], title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"eager": "tab:blue", "aot_eager": "tab:green", "npugraph_ex": "tab:orange"}
    eager_ms = runs["eager"]["per_token_ms"] if "eager" in runs else None
    names: list[str] = []
    for name, r in runs.items():
        label = "npugraph_ex" if name == OURS else name
        colour = colours.get(label, "tab:gray")
        names.append(label)
        steps = range(1, len(r["step_s"]) + 1)
        left.plot(steps, [s * 1e3 for s in r["step_s"]], label=label, marker=".", color=colour)
        if r["steady_from_step"] > 1:  # where its steady steps begin
            left.axvline(r["steady_from_step"] - 0.5, color=colour, linestyle=":", linewidth=1)
    left.set_yscale("log")
    left.set_xlabel("decode step")
    left.set_ylabel("ms (log)")
    left.set_title("per-step latency (dotted: steady steps begin, after the last "
                   "compile or capture)", fontsize=8)
    left.legend(fontsize=8)
    values = [r["per_token_ms"] for r in runs.values()]
    right.bar(names, values, color=[colours.get(k, "tab:gray") for k in names])
    for i, v in enumerate(values):
        speedup = f"\n{eager_ms / v:.2f}x eager" if eager_ms else ""
        right.text(i, v, f"{v:.3g} ms{speedup}", ha="center", va="bottom", fontsize=8)
    right.set_ylim(0, max(values) * 1.25)
    right.set_ylabel("ms per token (median of the steady steps)")
    right.set_title("per-token latency and speedup over eager", fontsize=9)
    if eager_ms and OURS in runs:
        title += f": npugraph_ex {eager_ms / runs[OURS]['per_token_ms']:.2f}x eager per token"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main())
