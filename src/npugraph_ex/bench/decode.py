"""(c) Decode-step latency of transformers Llama and GPT-2 per compiler.

On the CPU: tiny Llama and GPT-2, and the medium Llama (hidden 768, 12 layers, vocab 32000),
Llama at batches 1 and 8; on a GPU about 1B parameters (bfloat16). One step = the model's
forward over one token with a StaticCache plus the greedy argmax, at a fixed position, so every
sample does the same work. Targets: CPU tiny batch 1 (issue 7) ours <= 0.5x eager and <= 0.75x
aot_eager; every other CPU case (issue 14) ours <= 0.9x eager and <= 0.85x aot_eager; ours /
inductor is INFO. GPU (batch 1) ours <= 0.4x eager and no slower than torch's "cudagraphs"."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from npugraph_ex.bench.backends import (
    CUDA_ONLY,
    OURS,
    BenchTimeout,
    compile_with,
    ours_backend,
    ours_missing_reason,
    own_code,
    time_limit,
)
from npugraph_ex.bench.context import BenchContext, fmt_exc
from npugraph_ex.bench.report import Figure, Section
from npugraph_ex.bench.timing import measure_interleaved
from npugraph_ex.models import build_decoder, has_transformers, synchronize

PROMPT = 8


def backends_for(device: torch.device) -> list[str]:
    names = ["eager", "aot_eager", "inductor"]
    if device.type == "cuda":
        names += list(CUDA_ONLY)
    return [*names, OURS]


# (family, size, batch) on the CPU; `--decode-cases` picks some by label
CPU_CASES = (("llama", "tiny", 1), ("llama", "tiny", 8), ("llama", "medium", 1),
             ("llama", "medium", 8), ("gpt2", "tiny", 1))


def case_label(family: str, size: str, batch: int) -> str:
    return f"{family}-{size}" + (f"-b{batch}" if batch != 1 else "")


def cases_for(ctx: BenchContext, families: tuple[str, ...]) -> list[tuple[str, str, int]]:
    if not ctx.on_cpu:
        return [(f, "1b", 1) for f in families]
    cases = [c for c in CPU_CASES if c[0] in families]
    if ctx.quick:
        cases = cases[:1]
    wanted = ctx.decode_cases
    if wanted:
        known = {case_label(*c): c for c in CPU_CASES}
        unknown = [w for w in wanted if w not in known]
        if unknown:
            raise ValueError(f"--decode-cases {','.join(unknown)} unknown: use any of "
                             f"{','.join(known)}")
        cases = [known[w] for w in wanted]
    return cases


def run(ctx: BenchContext, families: tuple[str, ...] = ("llama", "gpt2")) -> Section:
    sec = Section("c", "decode-step latency per compiler", bar_unit="ms per step")
    if not has_transformers():
        families = ("builtin",)
        sec.figures.append(Figure("transformers", None, "", status="INFO",
                                  note="not installed: the built-in tiny transformer instead"))
    cases = cases_for(ctx, families) if has_transformers() else [("builtin", "tiny", 1)]
    for family, size, batch in cases:
        label = case_label(family, size, batch)
        if ctx.out_of_time():
            sec.figures.append(Figure.skip(label, "not run: --budget spent"))
            continue
        try:
            _one_model(ctx, sec, family, size, batch)
        except Exception as exc:  # one case that fails keeps the other cases' figures
            sec.figures.append(Figure.skip(label, f"failed: {fmt_exc(exc)}"))
            torch.compiler.reset()
        ctx.partial(sec)
    return sec


def _one_model(ctx: BenchContext, sec: Section, family: str, size: str, batch: int) -> None:
    dec = build_decoder(family, size, ctx.device, max_len=64 if ctx.on_cpu else 256, batch=batch)
    label = case_label(family, size, batch)
    token = dec.prefill(dec.prompt(PROMPT))
    position = dec.position(PROMPT)
    restore = dec.checkpoint()  # every sample decodes from the same cache state
    with torch.no_grad():
        expected = dec.step(token, position)
    results: dict[str, dict[str, object]] = {}
    compiled: dict[str, Callable[[], object]] = {}
    names = backends_for(ctx.device)
    if ctx.quick:
        names = [n for n in names if n != "inductor"]
    torch.compiler.reset()
    # ours right after eager (both always run): a --budget spent on the other compilers then
    # never pushes ours past a time limit around the whole run (gpu_check's)
    for name in ctx.steps(sorted(names, key=lambda n: n not in ("eager", OURS)),
                          desc=f"compile {label}"):
        if name == OURS and ours_backend() is None:
            results[name] = {"skipped": ours_missing_reason()}
            continue
        left = ctx.seconds_left()
        if left is not None and left <= 0 and name not in ("eager", OURS):
            results[name] = {"skipped": "not compiled: --budget spent"}
            continue
        budget = ctx.inductor_budget_s if name in ("inductor", "reduce-overhead") else 0.0
        if left is not None and name not in ("eager", OURS):
            budget = min(budget or left, left)  # no compile runs on past the --budget
        try:
            start = time.perf_counter()
            with time_limit(budget), torch.no_grad():
                step = compile_with(own_code(dec.step, name.replace("-", "_")), name)
                for _ in range(3):  # compile, warm up, capture
                    restore()
                    got = step(token, position)
                synchronize(ctx.device)
            compile_s = time.perf_counter() - start
        except Exception as exc:  # a compiler that fails is reported, not fatal
            timeout = _timeout_in(exc)  # dynamo may wrap the time limit's BenchTimeout
            results[name] = {"skipped": f"compile would take over {budget:.0f} s ({timeout})"
                             if timeout else f"fails to compile: {fmt_exc(exc)}"}
            continue
        results[name] = {"compile_s": compile_s, "same_token_as_eager": bool(torch.equal(got, expected))}

        def call(step: Callable[..., torch.Tensor] = step) -> None:
            with torch.no_grad():
                step(token, position)

        compiled[name] = call
    results = {n: results[n] for n in names if n in results}  # the figures in backends_for order
    compiled = {n: compiled[n] for n in names if n in compiled}
    ctx.say(f"timing {label}: {', '.join(compiled)} interleaved, {ctx.runs} rounds")
    timings = measure_interleaved(compiled, device=ctx.device, runs=ctx.runs, target_s=5e-3,
                                  setup=restore, max_inner=dec.max_len - PROMPT - 2)
    restore()
    bars: dict[str, float] = {}
    for name, timing in timings.items():
        results[name].update(ms=timing.median * 1e3, p10_ms=timing.p10 * 1e3,
                             p90_ms=timing.p90 * 1e3, runs=timing.runs, inner=timing.inner)
        bars[name if name != OURS else "ours (npugraph_ex)"] = timing.median * 1e3
    torch.compiler.reset()
    sec.data[label] = {"params": dec.params, "dtype": str(dec.dtype), "batch": batch,
                       "backends": results}
    sec.bars[f"{label} decode step"] = bars
    for name, res in results.items():
        if "skipped" in res:
            sec.figures.append(Figure.skip(f"{label} {name}", str(res["skipped"])))
        else:
            note = "" if res["same_token_as_eager"] else "token differs from eager"
            sec.figures.append(Figure(f"{label} {name} step", float(res["ms"]), "ms",  # type: ignore[arg-type]
                                      note=note))
    _targets(ctx, sec, label, results, strict=(size == "tiny" and batch == 1))


def _timeout_in(exc: BaseException | None) -> BenchTimeout | None:
    for _ in range(8):
        if exc is None or isinstance(exc, BenchTimeout):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _ms(results: dict[str, dict[str, object]], name: str) -> float | None:
    res = results.get(name, {})
    value = res.get("ms")
    return float(value) if isinstance(value, float) else None


def _targets(ctx: BenchContext, sec: Section, label: str, results: dict[str, dict[str, object]],
             strict: bool = True) -> None:
    ours = _ms(results, OURS)
    if not ctx.on_cpu:
        checks = [("eager", 0.4), ("cudagraphs", 1.0)]
    else:
        checks = [("eager", 0.5), ("aot_eager", 0.75)] if strict else [("eager", 0.9), ("aot_eager", 0.85)]
    for base, limit in checks:
        name = f"{label} ours / {base}"
        other = _ms(results, base)
        if ours is None or other is None:
            missing = OURS if ours is None else base
            sec.figures.append(Figure.skip(name, f"{missing} not measured", target=f"<= {limit}x"))
            continue
        ratio = ours / other
        sec.figures.append(Figure.check(name, ratio, "x", f"<= {limit}x", ratio <= limit))
    inductor = _ms(results, "inductor")
    if ours is not None and inductor is not None:
        sec.figures.append(Figure(f"{label} ours / inductor", ours / inductor, "x", status="INFO",
                                  note="inductor fuses kernels; we replay ATen ops"))
    same = results.get(OURS, {}).get("same_token_as_eager")
    if same is not None:
        sec.figures.append(Figure.check(f"{label} ours token equals eager", float(bool(same)), "",
                                        "== eager", bool(same)))
