"""(m) Graphs that update one of their inputs in place, where that input is a new tensor on every
call: the caller's fresh input (``x.mul_()`` in a forward), a state fed back (``h = f(h, x)``
with ``h.add_``), and the previous graph's result after a graph break inside repeated layers
(``res.add_()`` in each layer's second half), with default options and with clone_output.
Each made a capture on every call before (25-90x slower than eager on the CPU). The figures: how
many captures the timed calls made (target 0: the graphs replay), and ours / eager and ours /
aot_eager per call (for information: on small CPU graphs dynamo's frames and guards, which
aot_eager pays too, outweigh what a replay saves)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from npugraph_ex.bench._compat import dynamo_counters
from npugraph_ex.bench.context import BenchContext, fmt_exc
from npugraph_ex.bench.report import Figure, Section
from npugraph_ex.bench.timing import measure_interleaved

WIDTH, LAYERS, BATCH = 128, 4, 8
CHECKS = 6


class FreshInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.sub_(x.mean(-1, keepdim=True))  # the caller's tensor, updated in place
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class FedBack(FreshInput):
    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        for layer in self.layers:
            x = torch.tanh(layer(x))
        h.mul_(0.5).add_(x)  # the state, updated in place, then fed back by the caller
        return h * 1.0


class BrokenLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, res: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.a(x)
        res = res + y if res is not None else y * 1.0
        torch._dynamo.graph_break()
        res.add_(torch.tanh(self.b(res)))
        return torch.relu(res), res


class Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BrokenLayer() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        res = None
        for layer in self.layers:
            x, res = layer(x, res)
        return x


def _made() -> int:
    ours = dynamo_counters().get("npugraph_ex", {})
    return sum(int(v) for k, v in ours.items()
               if k.startswith(("capture_due_to_", "recapture_due_to_")))


def _case(name: str, device: torch.device) -> tuple[nn.Module, Callable[[Any], Any]]:
    """The model and a function that calls a model once with fresh inputs (a fed-back state is
    the model's own previous output)."""
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(BATCH, WIDTH, generator=gen).to(device)
    if name == "fed back":
        state: dict[int, torch.Tensor] = {}

        def fed(model: Any) -> Any:
            h = state.get(id(model), torch.zeros(BATCH, WIDTH, device=device))
            state[id(model)] = out = model(h, x0.clone())
            return out

        return FedBack().to(device), fed
    model = FreshInput() if name == "fresh input" else Broken()
    return model.to(device), lambda m: m(x0.clone())


def run(ctx: BenchContext) -> Section:
    sec = Section("m", "inputs updated in place, new on every call", bar_unit="us per call")
    device = ctx.device
    facts: dict[str, Any] = {}
    cases: list[tuple[str, dict[str, Any]]] = [
        ("fresh input", {}), ("fed back", {}), ("graph break", {}),
        ("graph break", {"clone_output": True})]
    with torch.inference_mode():
        for name, options in cases:
            label = name + (", clone_output" if options else "")
            torch.compiler.reset()
            model, call = _case(name, device)
            eager_model, eager_call = _case(name, device)
            eager_model.load_state_dict(model.state_dict())
            aot_model, aot_call = _case(name, device)
            aot_model.load_state_dict(model.state_dict())
            try:
                compiled = torch.compile(model, backend="npugraph_ex", options=options)
                aot = torch.compile(aot_model, backend="aot_eager")
                equal = True
                for _ in range(CHECKS):
                    want = eager_call(eager_model)
                    aot_call(aot)
                    equal = equal and bool(torch.allclose(call(compiled), want,
                                                          rtol=1e-4, atol=1e-4))
            except Exception as exc:
                sec.figures.append(Figure.skip(label, f"compile or replay failed: {fmt_exc(exc)}"))
                continue
            before = _made()
            timings = measure_interleaved(
                {"ours": functools.partial(call, compiled),
                 "eager": functools.partial(eager_call, eager_model),
                 "aot_eager": functools.partial(aot_call, aot)},
                device=device, runs=ctx.runs)
            during = _made() - before
            ours = timings["ours"].median
            facts[label] = {"replays_equal_eager": equal, "captures_while_timed": during,
                            **{f"{k}_us": t.median * 1e6 for k, t in timings.items()}}
            sec.figures.append(Figure.check(
                f"{label}: captures during the timed calls ({CHECKS} checked calls equal eager)",
                float(during), "captures", "0, equal eager", equal and during == 0))
            for other in ("eager", "aot_eager"):
                sec.figures.append(Figure(f"{label}: ours / {other} (median per call)",
                                          ours / timings[other].median, "x",
                                          note="for information"))
            sec.bars[label] = {k: t.median * 1e6 for k, t in timings.items()}
    sec.data.update(width=WIDTH, layers=LAYERS, batch=BATCH, results=facts)
    return sec
