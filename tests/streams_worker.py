"""One process of test_cache_compile_streams.py (this file holds no tests):

    python tests/streams_worker.py CACHE_DIR OUT_JSON MODE

A module holding two npugraph_runtime streams and two events (made in ``__init__``; recorded and
waited in the method) served by cache_compile. MODE ``other-first``: the process makes another
stream before the module (its streams get other labels); ``plain``: the module only; ``same``:
one stream object for both. Six calls with fresh inputs are compared with eager; the cache
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


def main(cache_dir: str, out: str, mode: str) -> None:
    if mode == "other-first":
        other = ngr.Stream("cpu")  # noqa: F841 - held, so the module's streams get other labels
    torch.manual_seed(0)
    model = TwoStreams(same=mode == "same").eval()
    fn = cache_compile(model.step, cache_dir=cache_dir)
    error = 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            x = torch.randn(8, 16)
            with torch.no_grad():
                want = model.step(x)
            error = max(error, (fn(x) - want).abs().max().item())
    captures = sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured"))
    with open(out, "w") as f:
        json.dump({"cache": dict(counters["npugraph_ex_cache"]), "captures": captures,
                   "max_error": error, "labels": [model.s0.label, model.s1.label],
                   "warnings": [str(w.message) for w in caught
                                if "npugraph" in str(w.message) or "stream" in str(w.message)]},
                  f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
