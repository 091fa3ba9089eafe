"""The seed documentation's cache example on the npugraph_ex backend, run in a fresh process by
test_cache_compile.py (this file holds no tests):

    python tests/test_cache_compile_worker.py CACHE_DIR OUT_JSON
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings

import torch

from npugraph_ex.inference import cache_compile

OPTIONS = {"capture_limit": 8}


@dataclasses.dataclass
class InputMeta:
    data: torch.Tensor
    is_prompt: bool


class Model(torch.nn.Module):
    def __init__(self, cache_dir: str) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.cached_prompt = cache_compile(self.prompt, cache_dir=cache_dir, options=OPTIONS)
        self.cached_decode = cache_compile(self.decode, cache_dir=cache_dir, options=OPTIONS)

    def forward(self, x: InputMeta, kv: list[torch.Tensor]) -> torch.Tensor:
        if x.is_prompt:
            return self.cached_prompt(x, kv)
        return self.cached_decode(x, kv)

    def _forward(self, x: InputMeta, kv: list[torch.Tensor]) -> torch.Tensor:
        return torch.relu(self.norm(self.linear(x.data)) + kv[0]) * kv[1]

    def prompt(self, x: InputMeta, kv: list[torch.Tensor]) -> torch.Tensor:
        return self._forward(x, kv)

    def decode(self, x: InputMeta, kv: list[torch.Tensor]) -> torch.Tensor:
        return self._forward(x, kv).sum(dim=0, keepdim=True)


def inputs(seq: int, is_prompt: bool, seed: int) -> tuple[InputMeta, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(seq, 8, generator=g)
    return InputMeta(data, is_prompt), [
        torch.randn(seq, 8, generator=g),
        torch.randn(seq, 8, generator=g),
    ]


def main(cache_dir: str, out: str) -> None:
    torch.manual_seed(0)
    model = Model(cache_dir).eval()
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

    captures = sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured_"))
    result = {
        "max_error": max(errors),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "cache": dict(counters["npugraph_ex_cache"]),
        "aot": dict(counters["aot_autograd"]),
        "captures": captures,
        "warnings": [str(w.message) for w in caught if "npugraph_ex cache" in str(w.message)],
    }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
