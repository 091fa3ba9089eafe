"""One gloo rank of test_cache_compile.py's rank test (this file holds no tests):

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/cache_rank_worker.py CACHE_DIR OUT_JSON

Joins the process group, wraps a method in cache_compile with no rank arguments, compares five
calls with eager and writes the entry paths and counters.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist

from npugraph_ex.inference import cache_compile


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x))


def main(cache_dir: str, out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(dist.get_rank())
        layer = Layer().eval()
        fn = cache_compile(layer.decode, cache_dir=cache_dir)
        errors = []
        for seed in range(5):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                want = layer.decode(x)
            errors.append(float((fn(x) - want).abs().max()))
        from torch._dynamo.utils import counters

        captures = sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured_"))
        result = {
            "rank": dist.get_rank(),
            "max_error": max(errors),
            "entries": sorted({str(p) for p in fn.entry_paths}),
            "cache": dict(counters["npugraph_ex_cache"]),
            "captures": captures,
        }
        with open(out, "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
