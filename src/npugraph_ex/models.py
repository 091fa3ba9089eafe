"""Small decoder models for the demo and the benchmarks, built from configs (nothing downloaded).

`build_decoder(family, size, device)` returns a `Decoder`: a model with a static KV cache, an
eager prefill and a one-token greedy decode step (`decoder.step`, the function users compile).
Families: "llama" and "gpt2" from `transformers` (random weights, seeded), and "builtin", a tiny
transformer of our own with a static KV cache updated by ``index_copy_``, used when transformers
is not installed. Sizes: "tiny" (CPU, seconds), "medium" (hidden 768, 12 layers; the llama has vocab 32000;
for CPU benchmarks) and "1b" (about a billion parameters, for a GPU).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

FAMILIES = ("llama", "gpt2", "builtin")
SIZES = ("tiny", "medium", "1b")

LLAMA_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
    # A CPU-sized model whose step is dominated by real kernels, not by host overhead (bench (c));
    # also the warm-start workload of bench (d).
    "medium": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                   num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048),
    # TinyLlama-1.1B's shape.
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048),
}
GPT2_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                 bos_token_id=0, eos_token_id=0),
    "medium": dict(vocab_size=32000, n_embd=768, n_layer=12, n_head=12, n_positions=512),
    # Between GPT-2 large and XL: about 1.0B parameters.
    "1b": dict(vocab_size=50257, n_embd=1536, n_layer=32, n_head=16, n_positions=1024),
}
BUILTIN_CONFIGS: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=512, hidden=64, layers=2, heads=4),
    "medium": dict(vocab_size=32000, hidden=768, layers=12, heads=12),
    "1b": dict(vocab_size=32000, hidden=2048, layers=20, heads=16),
}


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def best_device() -> torch.device:
    """CUDA if present, then an Ascend NPU (torch_npu imported only if installed), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    try:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():  # type: ignore[attr-defined]
            return torch.device("npu")
    except ImportError:
        pass
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]


@dataclass
class Decoder:
    """A model with its static KV cache. Call `prefill` (eager) first, then `step` per token.

    `step(token, cache_position)` takes the last token ``(batch, 1)`` and its position ``(1,)``
    and returns the greedy next token ``(batch, 1)``; the cache is updated in place, so the
    tensors of the cache keep their addresses across steps (what capture needs)."""

    family: str
    size: str
    model: nn.Module
    device: torch.device
    dtype: torch.dtype
    max_len: int
    batch: int
    cache: Any
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    note: str = ""
    params: int = field(default=0)

    def reset(self) -> None:
        """Zero the cache in place (addresses kept)."""
        if hasattr(self.cache, "reset"):
            self.cache.reset()

    def prompt(self, length: int = 8, seed: int = 0) -> torch.Tensor:
        vocab = int(getattr(self.model, "vocab_size", 0) or _vocab_of(self.model))
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (self.batch, length), generator=gen)
        return ids.to(self.device)

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """Run the prompt eagerly into the cache; returns the first generated token."""
        self.reset()
        positions = torch.arange(prompt.shape[1], device=self.device)
        logits = decoder_logits(self.family, self.model, prompt, positions, self.cache)
        return logits[:, -1, :].argmax(dim=-1, keepdim=True)

    def position(self, i: int) -> torch.Tensor:
        return torch.tensor([i], device=self.device, dtype=torch.long)

    def cache_tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds: keys and values, and in transformers 5.x the write
        position each layer advances in place (``cumulative_length``)."""
        if self.family == "builtin":
            return list(self.model.buffers())
        found: dict[int, torch.Tensor] = {}
        _collect_tensors(self.cache, found, depth=0)
        return list(found.values())

    def checkpoint(self) -> Callable[[], None]:
        """A function that puts the cache back, in place, to its state now (say, after the
        prefill), so that a benchmark can repeat one decode step as often as it likes: in
        transformers 5.x every step also moves the cache's write position on."""
        saved = [(t, t.clone()) for t in self.cache_tensors()]

        def restore() -> None:
            with torch.no_grad():
                for tensor, copy in saved:
                    tensor.copy_(copy)

        return restore


def _collect_tensors(obj: object, found: dict[int, torch.Tensor], depth: int) -> None:
    if isinstance(obj, torch.Tensor):
        found.setdefault(id(obj), obj)
    elif depth > 4 or isinstance(obj, (str, bytes, int, float, bool, nn.Module)) or obj is None:
        return
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _collect_tensors(item, found, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            _collect_tensors(item, found, depth + 1)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("transformers.cache"):
        for item in vars(obj).values():
            _collect_tensors(item, found, depth + 1)


def _vocab_of(model: nn.Module) -> int:
    emb = model.get_input_embeddings()  # type: ignore[operator]
    return int(emb.num_embeddings)


def decoder_logits(
    family: str, model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, cache: Any
) -> torch.Tensor:
    """Logits of ``ids`` at ``positions``, writing their keys and values into ``cache``."""
    if family == "builtin":
        out: torch.Tensor = model(ids, positions)
        return out
    params = _forward_params(type(model))
    # transformers 5.x renamed past_key_values to cache (5.40 drops the old name) and dropped
    # cache_position (positions come from position_ids); 4.x takes both old names.
    kwargs: dict[str, Any] = {
        "input_ids": ids,
        "position_ids": positions.unsqueeze(0).expand(ids.shape[0], -1),
        "cache" if "cache" in params else "past_key_values": cache,
        "use_cache": True,
    }
    if "cache_position" in params:
        kwargs["cache_position"] = positions
    result = model(**kwargs)
    logits = result.logits if hasattr(result, "logits") else result[0]
    assert isinstance(logits, torch.Tensor)
    return logits


_FORWARD_PARAMS: dict[type, frozenset[str]] = {}


def _forward_params(cls: type) -> frozenset[str]:
    """The named parameters of a model class's forward (read once per class)."""
    if cls not in _FORWARD_PARAMS:
        forward = getattr(cls, "forward", None)
        names = inspect.signature(forward).parameters if forward is not None else {}
        _FORWARD_PARAMS[cls] = frozenset(names)
    return _FORWARD_PARAMS[cls]


def _make_step(
    family: str, model: nn.Module, cache: Any
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def decode_step(token: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        logits = decoder_logits(family, model, token, cache_position, cache)
        return logits[:, -1, :].argmax(dim=-1, keepdim=True)

    decode_step.__name__ = f"{family}_decode_step"
    return decode_step


def static_cache(config: Any, batch: int, max_len: int, device: torch.device,
                 dtype: torch.dtype) -> Any:
    """A transformers StaticCache across API versions: before 4.56 it takes the batch size,
    device and dtype and allocates at once; from 4.56 (and in 5.x) it takes the config and
    max_cache_len and allocates lazily on the first update (the eager prefill)."""
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kwargs: dict[str, Any] = {"config": config, "max_cache_len": max_len}
    for name, value in (("max_batch_size", batch), ("batch_size", batch), ("device", device),
                        ("dtype", dtype)):
        if name in params:
            kwargs[name] = value
    return StaticCache(**kwargs)


def _transformers_model(family: str, size: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
    import transformers

    if family == "llama":
        config: Any = transformers.LlamaConfig(**LLAMA_CONFIGS[size])  # type: ignore[no-untyped-call]
        cls: Any = transformers.LlamaForCausalLM
    else:
        config = transformers.GPT2Config(**GPT2_CONFIGS[size])  # type: ignore[no-untyped-call]
        cls = transformers.GPT2LMHeadModel
    # sdpa is the default where available; set it so 4.x and 5.x build the same attention.
    with contextlib.suppress(Exception):  # a release that refuses the setter keeps its default
        config._attn_implementation = "sdpa"
    with torch.device(device):
        model: nn.Module = cls(config)
    return model.to(dtype=dtype)


def build_decoder(
    family: str = "llama",
    size: str = "tiny",
    device: torch.device | str | None = None,
    *,
    dtype: torch.dtype | None = None,
    max_len: int = 128,
    batch: int = 1,
    seed: int = 0,
) -> Decoder:
    """Build a seeded model with random weights and a static cache of ``max_len`` positions.

    family "llama"/"gpt2" need transformers; without it they fall back to "builtin" and say so
    in ``Decoder.note``. dtype defaults to float32 on the CPU and for "tiny", else bfloat16."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not allowed: use one of {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not allowed: use one of {', '.join(SIZES)}")
    dev = torch.device(device) if device is not None else best_device()
    if dtype is None:
        # Tiny models stay in float32 everywhere, so greedy tokens compare exactly across
        # compilers; the 1B models run in bfloat16 on accelerators, as they would be served.
        dtype = torch.float32 if dev.type == "cpu" or size == "tiny" else torch.bfloat16
    note = ""
    if family != "builtin" and not has_transformers():
        note = f"transformers is not installed: using the built-in tiny transformer instead of {family}"
        family = "builtin"
    torch.manual_seed(seed)
    if family == "builtin":
        cfg = BUILTIN_CONFIGS[size]
        with torch.device(dev):
            model: nn.Module = TinyDecoder(max_len=max_len, batch=batch, **cfg)
        model = model.to(dtype=dtype)
        cache: Any = model
    else:
        model = _transformers_model(family, size, dev, dtype)
        config: Any = model.config
        cache = static_cache(config, batch, max_len, dev, dtype)
    model.eval().requires_grad_(False)
    params = sum(p.numel() for p in model.parameters())
    return Decoder(family=family, size=size, model=model, device=dev, dtype=dtype, max_len=max_len,
                   batch=batch, cache=cache, step=_make_step(family, model, cache), note=note,
                   params=params)


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int, max_len: int, batch: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.norm1 = nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.RMSNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)
        shape = (batch, heads, max_len, self.head_dim)
        self.k_cache: torch.Tensor
        self.v_cache: torch.Tensor
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        self.k_cache.index_copy_(2, positions, k)
        self.v_cache.index_copy_(2, positions, v)
        attn = nn.functional.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        x = x + self.out(attn.transpose(1, 2).reshape(b, s, h))
        out: torch.Tensor = x + self.down(nn.functional.gelu(self.up(self.norm2(x))))
        return out


class TinyDecoder(nn.Module):
    """A small pre-norm decoder with a static KV cache in its buffers (no transformers needed).

    ``forward(ids, positions)`` writes the keys and values of ``positions`` into the cache with
    ``index_copy_`` and attends over every cached position up to each query's own."""

    def __init__(self, vocab_size: int, hidden: int, layers: int, heads: int, max_len: int,
                 batch: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, hidden)
        self.pos = nn.Embedding(max_len, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, heads, max_len, batch) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab_size, bias=False)
        self.slots: torch.Tensor
        self.register_buffer("slots", torch.arange(max_len), persistent=False)
        nn.init.normal_(self.embed.weight, std=1.0 / math.sqrt(hidden))

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def reset(self) -> None:
        for block in self.blocks:
            assert isinstance(block, _Block)
            block.k_cache.zero_()
            block.v_cache.zero_()

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos(positions)
        mask = self.slots[None, :] <= positions[:, None]
        for block in self.blocks:
            x = block(x, positions, mask)
        out: torch.Tensor = self.head(self.norm(x))
        return out
