"""A cached method that reads a module global, a closure cell and a module attribute, each set
from the environment, run in a fresh process by the tests:

    SCALE=2 CELL=5 SHIFT=1 python values_worker.py CACHE_DIR OUT_JSON

Calls the cached method on fresh inputs, compares with eager and writes what happened.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
from npugraph_cache import CacheWarning, cache_compile

SCALE = float(os.environ["SCALE"])


def _make_add() -> object:
    cell = float(os.environ["CELL"])

    def add(x: torch.Tensor) -> torch.Tensor:
        return x + cell

    return add


ADD = _make_add()


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.shift = float(os.environ["SHIFT"])

    def step(self, x: torch.Tensor) -> torch.Tensor:
        return ADD(self.lin(x) * SCALE) - self.shift  # type: ignore[operator]


def main(cache_dir: str, out: str) -> None:
    global SCALE
    torch.manual_seed(0)
    module = Scaled().eval()
    fn = cache_compile(module.step, cache_dir=cache_dir)
    errors = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(5):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                want = module.step(x)
            errors.append(float((fn(x) - want).abs().max()))
        if os.environ.get("CHANGE_IN_PROCESS"):
            SCALE = SCALE + 1.0
            x = torch.randn(2, 4)
            with torch.no_grad():
                want = module.step(x)
            errors.append(float((fn(x) - want).abs().max()))
    from torch._dynamo.utils import counters

    result = {
        "max_error": max(errors),
        # how entries were obtained (direct-dispatch plans are counted too, and left out here)
        "cache": dict(counters["npugraph_ex_cache"]),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, CacheWarning)],
        "entries": sorted({str(p) for p in fn.entry_paths}),
    }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
