"""One process of test_cache_compile_streams.py (this file holds no tests):

    python tests/streams_worker.py CACHE_DIR OUT_JSON MODE

A module holding two npugraph_runtime streams and two events (made in ``__init__``; recorded and
waited in the method) served by cache_compile. MODE ``other-first``: the process makes another
stream before the module (its streams get other labels); ``plain``: the module only; ``same``:
one stream object for both. ``torch-plain``, ``torch-same``: the same with ``torch.Stream`` /
``torch.Event`` (``TorchStreams``); ``torch-other-first``: the process first compiles a graph of
its own on a torch stream; ``torch-swap``: the module's second stream becomes its first after
three calls; ``torch-global``: the second stream is a global (``SIDE``);
``torch-global-swap``: that global becomes the module's first stream after three calls. Six calls with fresh inputs are compared with eager; the cache
counters, the captures and the warnings are written as JSON."""

from __future__ import annotations

import json
import sys
import warnings

import npugraph_runtime as ngr
import torch
from torch._dynamo.utils import counters

from npugraph_ex.inference import cache_compile


class TwoStreams(torch.nn.Module):
    def __init__(self, same: bool) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 16)
        self.down = torch.nn.Linear(16, 16)
        self.s0 = ngr.Stream("cpu")
        self.s1 = self.s0 if same else ngr.Stream("cpu")
        self.ready = ngr.Event("cpu")
        self.done = ngr.Event("cpu")

    def step(self, x: torch.Tensor) -> torch.Tensor:
        with ngr.stream(self.s0):
            h = torch.relu(self.up(x))
            self.ready.record(self.s0)
        with ngr.stream(self.s1):
            self.ready.wait(self.s1)
            y = self.down(h) * 2
            self.done.record(self.s1)
        self.done.wait(ngr.current_stream("cpu"))
        return y + x


SIDE = torch.Stream("cpu")  # the second side stream as a global (modes torch-global*)


class TorchStreams(torch.nn.Module):
    """The same two branches with torch's own streams and events (``torch.npu.Stream()`` /
    ``torch.cuda.Stream()`` on a device): ``main`` is only waited by, so it is the graph's own
    stream. torch cannot record a ``torch.Event`` eagerly on the CPU, so eager is ``reference``:
    the same ops without the stream calls, which cannot change values."""

    def __init__(self, same: bool, use_global: bool = False) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 16)
        self.down = torch.nn.Linear(16, 16)
        self.use_global = use_global
        self.main = torch.Stream("cpu")
        self.s0 = torch.Stream("cpu")
        self.s1 = self.s0 if same else torch.Stream("cpu")
        self.ready = torch.Event("cpu")
        self.done = torch.Event("cpu")

    def step(self, x: torch.Tensor) -> torch.Tensor:
        s1 = SIDE if self.use_global else self.s1
        self.s0.wait_stream(self.main)
        with self.s0:
            h = torch.relu(self.up(x))
        self.ready.record(self.s0)
        self.ready.wait(s1)
        with s1:
            y = self.down(h) * 2
        self.done.record(s1)
        self.done.wait(self.main)
        return y + x

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))) * 2 + x


def _other_torch_stream_graph() -> None:
    """A graph of this process's own on a torch side stream, compiled before the entry is
    loaded: its stream labels must not be the loaded graph's."""
    side = torch.Stream("cpu")

    def other(x: torch.Tensor) -> torch.Tensor:
        with side:
            y = x * 3
        return y

    torch.compile(other, backend="npugraph_ex", fullgraph=True)(torch.randn(4))


def main(cache_dir: str, out: str, mode: str) -> None:
    if mode == "other-first":
        other = ngr.Stream("cpu")  # noqa: F841 - held, so the module's streams get other labels
    if mode == "torch-other-first":
        _other_torch_stream_graph()
    torch.manual_seed(0)
    same = mode in ("same", "torch-same")
    model: TwoStreams | TorchStreams = (
        TorchStreams(same, mode.startswith("torch-global")) if mode.startswith("torch")
        else TwoStreams(same)).eval()
    eager = model.reference if isinstance(model, TorchStreams) else model.step
    fn = cache_compile(model.step, cache_dir=cache_dir)
    error = 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(6):
            if mode == "torch-swap" and i == 3:  # one stream object for both, in this process
                model.s1 = model.s0
            if mode == "torch-global-swap" and i == 3:  # the global stream is the module's s0
                globals()["SIDE"] = model.s0
            x = torch.randn(8, 16)
            with torch.no_grad():
                want = eager(x)
            error = max(error, (fn(x) - want).abs().max().item())
    captures = sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured"))
    with open(out, "w") as f:
        json.dump({"cache": dict(counters["npugraph_ex_cache"]), "captures": captures,
                   "max_error": error,
                   "labels": [getattr(model.s0, "label", None), getattr(model.s1, "label", None)],
                   "warnings": [str(w.message) for w in caught
                                if "npugraph" in str(w.message) or "stream" in str(w.message)]},
                  f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
