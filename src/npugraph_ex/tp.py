"""Tensor-parallel decode as users write it with torch.distributed: a small Llama-style decoder
whose attention heads and MLP columns are split over the ranks, compiled with the backend.

`LlamaTP(config)` is the single-process model; `LlamaTP.shard(full, rank, world)` cuts rank
``rank``'s shard from it: Q/K/V and gate/up are column-parallel (each rank holds its heads and its
slice of the intermediate size), o_proj and down_proj are row-parallel (each rank's partial sums
are added by ``dist.all_reduce``), the static KV cache holds the rank's KV heads only; embeddings,
norms and the LM head are replicated. `run_rank` is one rank's decode, eager and compiled, and
`spawn` starts the ranks on 127.0.0.1 with gloo."""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

BACKEND = "npugraph_ex"


@dataclass(frozen=True)
class TPConfig:
    vocab: int = 256
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    layers: int = 2
    max_len: int = 64
    eps: float = 1e-6
    rope_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check_world(self, world: int) -> None:
        for name in ("heads", "kv_heads", "intermediate"):
            if getattr(self, name) % world:
                raise ValueError(
                    f"world size {world} does not divide {name}={getattr(self, name)}: tensor "
                    f"parallelism splits heads, KV heads and the intermediate size evenly"
                )


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Layer(nn.Module):
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(self, cfg: TPConfig, world: int, batch: int) -> None:
        super().__init__()
        hd, heads, kv = cfg.head_dim, cfg.heads // world, cfg.kv_heads // world
        self.heads, self.kv_heads, self.head_dim = heads, kv, hd
        self.q_proj = nn.Linear(cfg.hidden, heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, kv * hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, kv * hd, bias=False)
        self.o_proj = nn.Linear(heads * hd, cfg.hidden, bias=False)
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate // world, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate // world, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate // world, cfg.hidden, bias=False)
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden))
        self.mlp_norm = nn.Parameter(torch.ones(cfg.hidden))
        self.register_buffer("k_cache", torch.zeros(batch, kv, cfg.max_len, hd), persistent=False)
        self.register_buffer("v_cache", torch.zeros(batch, kv, cfg.max_len, hd), persistent=False)


class LlamaTP(nn.Module):
    """The decoder; with ``world`` > 1 one rank's shard (see the module docstring)."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor

    def __init__(self, cfg: TPConfig, world: int = 1, batch: int = 1) -> None:
        super().__init__()
        cfg.check_world(world)
        self.cfg, self.world = cfg, world
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(_Layer(cfg, world, batch) for _ in range(cfg.layers))
        self.blocks: list[_Layer] = list(self.layers)  # type: ignore[arg-type]  # typed view
        self.norm = nn.Parameter(torch.ones(cfg.hidden))
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        inv = 1.0 / cfg.rope_base ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.max_len).float(), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.register_buffer("positions", torch.arange(cfg.max_len), persistent=False)

    @classmethod
    def shard(cls, full: LlamaTP, rank: int, world: int) -> LlamaTP:
        """Rank ``rank``'s shard, its weights cut from ``full``'s."""
        cfg = full.cfg
        part = cls(cfg, world, batch=full.blocks[0].k_cache.shape[0])
        hd = cfg.head_dim

        def rows(w: torch.Tensor, n: int) -> torch.Tensor:
            return w.chunk(world, dim=0)[rank].clone() if n else w

        with torch.no_grad():
            part.embed.weight.copy_(full.embed.weight)
            part.norm.copy_(full.norm)
            part.lm_head.weight.copy_(full.lm_head.weight)
            for mine, whole in zip(part.blocks, full.blocks, strict=True):
                q = whole.q_proj.weight.view(cfg.heads, hd, cfg.hidden)
                k = whole.k_proj.weight.view(cfg.kv_heads, hd, cfg.hidden)
                v = whole.v_proj.weight.view(cfg.kv_heads, hd, cfg.hidden)
                mine.q_proj.weight.copy_(rows(q, 1).reshape(-1, cfg.hidden))
                mine.k_proj.weight.copy_(rows(k, 1).reshape(-1, cfg.hidden))
                mine.v_proj.weight.copy_(rows(v, 1).reshape(-1, cfg.hidden))
                mine.o_proj.weight.copy_(whole.o_proj.weight.chunk(world, dim=1)[rank])
                mine.gate_proj.weight.copy_(rows(whole.gate_proj.weight, 1))
                mine.up_proj.weight.copy_(rows(whole.up_proj.weight, 1))
                mine.down_proj.weight.copy_(whole.down_proj.weight.chunk(world, dim=1)[rank])
                mine.attn_norm.copy_(whole.attn_norm)
                mine.mlp_norm.copy_(whole.mlp_norm)
        return part

    def reset(self) -> None:
        for layer in self.blocks:
            layer.k_cache.zero_()
            layer.v_cache.zero_()

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(x)  # the row-parallel projection's partial sums
        return x

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits of ``ids`` ([batch, seq]) at positions ``pos`` ([seq]); the KV cache is
        written at ``pos`` (index_copy_) and attention reads it whole, masked to pos."""
        cfg = self.cfg
        b, s = ids.shape
        x = self.embed(ids)
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]
        mask = self.positions[None, :] <= pos[:, None]  # [seq, max_len]
        for layer in self.blocks:
            h = _rms(x, layer.attn_norm, cfg.eps)
            q = layer.q_proj(h).view(b, s, layer.heads, layer.head_dim).transpose(1, 2)
            k = layer.k_proj(h).view(b, s, layer.kv_heads, layer.head_dim).transpose(1, 2)
            v = layer.v_proj(h).view(b, s, layer.kv_heads, layer.head_dim).transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            layer.k_cache.index_copy_(2, pos, k)
            layer.v_cache.index_copy_(2, pos, v)
            group = layer.heads // layer.kv_heads
            keys = layer.k_cache.repeat_interleave(group, dim=1)
            values = layer.v_cache.repeat_interleave(group, dim=1)
            a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            a = a.transpose(1, 2).reshape(b, s, layer.heads * layer.head_dim)
            x = x + self._reduce(layer.o_proj(a))
            h = _rms(x, layer.mlp_norm, cfg.eps)
            x = x + self._reduce(layer.down_proj(F.silu(layer.gate_proj(h)) * layer.up_proj(h)))
        logits: torch.Tensor = self.lm_head(_rms(x, self.norm, cfg.eps))
        return logits


def build(cfg: TPConfig | None = None, seed: int = 0) -> LlamaTP:
    """The single-process model, random weights from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    model = LlamaTP(cfg or TPConfig()).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def prompt(cfg: TPConfig, length: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg.vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy(model: nn.Module, step: Any, ids: torch.Tensor, n: int) -> tuple[list[int], list[float]]:
    """Eager prefill of ``ids``, then ``n`` one-token steps with ``step``; tokens and per-step
    seconds (the first steps include compiling and capturing)."""
    model.reset()  # type: ignore[operator]
    length = ids.shape[1]
    logits = model(ids, torch.arange(length))
    token = logits[:, -1].argmax(-1, keepdim=True)
    tokens, seconds = [int(token)], []
    for i in range(n - 1):
        pos = torch.tensor([length + i])
        start = time.perf_counter()
        logits = step(token.clone(), pos)
        token = logits[:, -1].argmax(-1, keepdim=True)
        seconds.append(time.perf_counter() - start)
        tokens.append(int(token))
    return tokens, seconds


SKIP_STEPS = 2  # compile, warm-up and capture: not per-token latency


def _counters() -> dict[str, int]:
    return dict(torch._dynamo.utils.counters["npugraph_ex"])


def _decode(rank: int, world: int, tokens: int) -> dict[str, Any]:
    full = build()
    model = LlamaTP.shard(full, rank, world).eval()
    ids = prompt(full.cfg)
    eager_tokens, eager_s = greedy(model, model, ids, tokens)
    compiled = torch.compile(model, backend=BACKEND, fullgraph=True, dynamic=False)
    ours_tokens, ours_s = greedy(model, compiled, ids, tokens)
    counters = _counters()
    return {
        "eager_tokens": eager_tokens, "tokens": ours_tokens,
        "captured": sum(v for k, v in counters.items() if k.startswith("captured_")),
        # the loop still holds the last logits when it calls the next step: the second capture
        # of the key keeps them valid, and the two captures alternate from then on
        "held_output_captures": sum(v for k, v in counters.items()
                                    if k.startswith("capture_due_to_held_outputs_")),
        "fallbacks": sum(v for k, v in counters.items() if k.startswith("eager_fallback")),
        "eager_ms": 1e3 * statistics.median(eager_s[SKIP_STEPS:]),
        "ours_ms": 1e3 * statistics.median(ours_s[SKIP_STEPS:]),
    }


def as_rank(rank: int, world: int, port: int, out: str, threads: int, timeout_s: float,
            work: Callable[[], dict[str, Any]]) -> None:
    """Join the gloo group on 127.0.0.1, run ``work``, write its result (or error) to ``out``."""
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = {"rank": rank, **work()}
    except Exception as exc:  # reported by the parent, which exits non-zero
        result = {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def run_rank(rank: int, world: int, port: int, out: str, tokens: int, threads: int = 1) -> None:
    """One rank of the decode: eagerly, then compiled with the backend."""
    as_rank(rank, world, port, out, threads, 60, lambda: _decode(rank, world, tokens))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawned(index: int, target: Callable[..., None], world: int, port: int, folder: str,
             args: tuple[Any, ...]) -> None:
    target(index, world, port, os.path.join(folder, f"rank{index}.json"), *args)


def spawn(world: int = 2, tokens: int = 16, threads: int = 1, join_s: float = 120,
          target: Callable[..., None] | None = None, args: tuple[Any, ...] | None = None,
          ) -> list[dict[str, Any]]:
    """Run ``world`` gloo ranks on 127.0.0.1 (spawned processes); their results, by rank.
    ``target(rank, world, port, out, *args)`` (module level, so a spawned process finds it) is
    one rank; the default is the decode (``run_rank``)."""
    from torch.multiprocessing.spawn import start_processes

    if target is None:
        target, args = run_rank, (tokens, threads)
    with tempfile.TemporaryDirectory(prefix="npugraph_tp_") as folder:
        ctx = start_processes(  # type: ignore[no-untyped-call]
            _spawned, args=(target, world, _port(), folder, args or ()),
            nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + join_s
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"the {world} tensor-parallel ranks did not finish in {join_s} s")
        return [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]


def single_process_tokens(tokens: int = 16) -> list[int]:
    """Greedy tokens of the unsharded model, eagerly: what every rank must produce."""
    full = build()
    return greedy(full, full, prompt(full.cfg), tokens)[0]


def config_dict() -> dict[str, Any]:
    return asdict(TPConfig())
