"""The seed documentation's cache example, run in a fresh process by the tests.

    python cache_worker.py CACHE_DIR OUT_JSON [--random]

Builds the model (fixed seed), wraps prompt and decode in cache_compile, calls each on real
inputs, compares with eager and writes what happened (dynamo frames traced, cache counters,
warnings, max error) as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings

import torch
from npugraph_cache import cache_compile


@dataclasses.dataclass
class InputMeta:
    data: torch.Tensor
    is_prompt: bool


class Model(torch.nn.Module):
    def __init__(self, cache_dir: str, random: bool = False) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.random = random
        self.cached_prompt = cache_compile(self.prompt, cache_dir=cache_dir)
        self.cached_decode = cache_compile(self.decode, cache_dir=cache_dir)

    def forward(self, x: InputMeta, kv: list[torch.Tensor]) -> torch.Tensor:
        if x.is_prompt:
            return self.cached_prompt(x, kv)
        return self.cached_decode(x, kv)

    def _forward(self, x: InputMeta, kv: list[torch.Tensor]) -> torch.Tensor:
        h = self.norm(self.linear(x.data)) + kv[0]
        if self.random:
            h = h + torch.rand_like(h)
        return torch.relu(h) * kv[1]

    def prompt(self, x: InputMeta, kv: list[torch.Tensor]) -> torch.Tensor:
        return self._forward(x, kv)

    def decode(self, x: InputMeta, kv: list[torch.Tensor]) -> torch.Tensor:
        return self._forward(x, kv).sum(dim=0, keepdim=True)


def inputs(seq: int, is_prompt: bool, seed: int) -> tuple[InputMeta, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(seq, 8, generator=g)
    kv = [torch.randn(seq, 8, generator=g), torch.randn(seq, 8, generator=g)]
    return InputMeta(data, is_prompt), kv


def main(cache_dir: str, out: str, random: bool) -> None:
    torch.manual_seed(0)
    model = Model(cache_dir, random=random).eval()
    errors = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seq, is_prompt, seed in ((16, True, 1), (1, False, 2), (12, True, 3), (1, False, 4)):
            x, kv = inputs(seq, is_prompt, seed)
            got = model(x, kv)
            with torch.no_grad():
                want = model.prompt(x, kv) if is_prompt else model.decode(x, kv)
            errors.append(float((got - want).abs().max()))
    from torch._dynamo.utils import counters

    result = {
        "max_error": max(errors),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "frames": counters["frames"]["total"],
        "cache": dict(counters["npugraph_ex_cache"]),
        "warnings": [str(w.message) for w in caught if "npugraph_ex cache" in str(w.message)],
        "entries": [
            str(p) for f in (model.cached_prompt, model.cached_decode) for p in f.entry_paths
        ],
    }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--random" in sys.argv[3:])
