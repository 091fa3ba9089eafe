"""One rank of test_tp_transformers.py: transformers' own tensor-parallel plan (tp_plan="auto")
on gloo, a tiny random Llama saved and loaded from a temporary folder, greedy decoding with a
StaticCache, eagerly and compiled with backend="npugraph_ex".

    python tp_hf_worker.py RANK PORT MODEL_DIR OUT_JSON TOKENS"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

from npugraph_ex.models import LLAMA_CONFIGS, decoder_logits, static_cache


def greedy(model: Any, step: Any, ids: torch.Tensor, n: int) -> list[int]:
    cache = static_cache(model.config, 1, ids.shape[1] + n + 2, torch.device("cpu"), torch.float32)
    logits = decoder_logits("llama", model, ids, torch.arange(ids.shape[1]), cache)
    token = logits[:, -1].argmax(-1, keepdim=True)
    tokens = [int(token)]
    for i in range(n - 1):
        logits = step(model, token, torch.tensor([ids.shape[1] + i]), cache)
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(token))
    return tokens


def main() -> None:
    rank, port, folder, out, n = (int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4],
                                  int(sys.argv[5]))
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    from transformers import LlamaConfig, LlamaForCausalLM

    result: dict[str, Any] = {}
    try:
        if rank == 0:
            torch.manual_seed(0)
            LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIGS["tiny"])).save_pretrained(folder)
        dist.barrier()
        full = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tp = LlamaForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.float32).eval()
        ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(1))

        def eager(m: Any, token: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor:
            return decoder_logits("llama", m, token, pos, cache)

        compiled = torch.compile(eager, backend="npugraph_ex", fullgraph=True, dynamic=False)
        with torch.no_grad():
            result["single"] = greedy(full, eager, ids, n)
            result["eager_tp"] = greedy(tp, eager, ids, n)
            result["ours_tp"] = greedy(tp, compiled, ids, n)
        counters = dict(torch._dynamo.utils.counters["npugraph_ex"])
        result["captured"] = sum(v for k, v in counters.items() if k.startswith("captured_"))
        result["held_output_captures"] = sum(
            v for k, v in counters.items() if k.startswith("capture_due_to_held_outputs_"))
        result["fallbacks"] = sum(v for k, v in counters.items() if k.startswith("eager_fallback"))
    except Exception:
        result["crash"] = traceback.format_exc()[-3000:]
    with open(out, "w") as f:
        json.dump(result, f)
    os._exit(0)


if __name__ == "__main__":
    main()
