"""One process of test_warm_start_imports.py (this file holds no tests):

    python tests/warm_start_worker.py CACHE_DIR OUT_JSON

Compiles (first process) or loads (later ones) a small decoder step with cache_compile, checks 6
calls with fresh inputs against eager, and reports which of our modules the process imported."""

from __future__ import annotations

import json
import sys

import torch

from npugraph_ex.inference import cache_compile


class Step(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)

    def decode(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        kv.mul_(0.5).add_(x)  # an in-place epilogue on an input, as a KV cache update is
        return torch.cat([torch.relu(self.norm(self.proj(x))), kv], dim=-1) * 2


def main(cache_dir: str, out: str) -> None:
    torch.manual_seed(0)
    step = Step().eval()
    fn = cache_compile(step.decode, cache_dir=cache_dir, options={"capture_limit": 4})
    errors = []
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        x, kv = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
        kv_eager = kv.clone()
        with torch.no_grad():
            got = fn(x, kv)
            want = step.decode(x, kv_eager)
        errors.append(max(float((got - want).abs().max()), float((kv - kv_eager).abs().max())))
    from torch._dynamo.utils import counters

    result = {
        "max_error": max(errors),
        "cache": dict(counters["npugraph_ex_cache"]),
        "captures": sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured_")),
        "modules": sorted(m for m in sys.modules if m.split(".")[0] in
                          ("npugraph_ex", "npugraph_backend", "npugraph_passes", "npugraph_runtime",
                           "npugraph_cache", "transformers")),
    }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
