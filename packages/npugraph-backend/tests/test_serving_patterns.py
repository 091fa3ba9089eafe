"""Patterns an inference engine (vLLM-style) uses, replayed and compared with an eager twin (a
deep copy): a paged KV cache written at a slot mapping that changes every call and read back
through a block table, batch-size buckets called in a changing order with outputs held across
buckets, attention metadata as a dataclass or a dict of tensors and ints, sampling outside the
graph fed back in a decode loop, and a prefill graph and a decode graph sharing one cache. Every
call's outputs and the KV caches are compared with eager over >= 6 calls with fresh inputs, kept
outputs again after later calls, and a capture must have happened (counters)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from npugraph_runtime import graph_pool_handle
from torch import nn

BLOCK = 4
BLOCKS = 16
HEADS = 2
HEAD_DIM = 8
DIM = HEADS * HEAD_DIM
VOCAB = 32
BUCKETS = (1, 2, 4, 8, 2, 1, 8, 4, 2)


@dataclasses.dataclass
class Meta:
    slot_mapping: torch.Tensor  # [tokens], where each new token's key/value goes
    block_tables: torch.Tensor  # [batch, blocks per sequence]
    seq_lens: torch.Tensor  # [batch]
    max_seq_len: int
    num_tokens: int


class PagedAttention(nn.Module):
    def __init__(self, write: str) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.o = nn.Linear(DIM, DIM)
        self.write = write
        self.register_buffer("kv", torch.zeros(2, BLOCKS * BLOCK, HEADS, HEAD_DIM))

    def forward(self, x: torch.Tensor, meta: Meta, kv: torch.Tensor | None = None) -> torch.Tensor:
        kv = self.kv if kv is None else kv
        q, k, v = self.qkv(x).view(-1, 3, HEADS, HEAD_DIM).unbind(1)
        slots = meta.slot_mapping
        if self.write == "index_copy_":
            kv[0].index_copy_(0, slots, k)
            kv[1].index_copy_(0, slots, v)
        elif self.write == "index_put_":
            kv[0].index_put_((slots,), k)
            kv[1].index_put_((slots,), v)
        else:
            idx = slots.view(-1, 1, 1).expand(-1, HEADS, HEAD_DIM)
            kv[0].scatter_(0, idx, k)
            kv[1].scatter_(0, idx, v)
        batch, per_seq = meta.block_tables.shape
        read = (meta.block_tables.unsqueeze(-1) * BLOCK + torch.arange(BLOCK)).view(-1)
        keys = kv[0].index_select(0, read).view(batch, per_seq * BLOCK, HEADS, HEAD_DIM)
        values = torch.gather(kv[1], 0, read.view(-1, 1, 1).expand(-1, HEADS, HEAD_DIM))
        values = values.view(batch, per_seq * BLOCK, HEADS, HEAD_DIM)
        tokens = x.shape[0]
        queries = q.view(batch, tokens // batch, HEADS, HEAD_DIM).transpose(1, 2)
        mask = torch.arange(per_seq * BLOCK).view(1, 1, 1, -1) < meta.seq_lens.view(batch, 1, 1, 1)
        att = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask)
        return self.o(att.transpose(1, 2).reshape(tokens, DIM)) * (meta.max_seq_len / 10.0)


class PagedModel(nn.Module):
    def __init__(self, write: str = "index_copy_") -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(PagedAttention(write) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: Meta) -> torch.Tensor:
        x = self.emb(ids) + positions.unsqueeze(-1).float() * 0.01
        for layer in self.layers:
            x = x + layer(x, meta)
        return self.head(x)

    def caches(self) -> list[torch.Tensor]:
        return [layer.kv for layer in self.layers]


class DictMetaModel(PagedModel):
    """The engine passes the metadata as a dict and the caches as arguments."""

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                md: dict[str, Any], kv0: torch.Tensor, kv1: torch.Tensor) -> torch.Tensor:
        meta = Meta(**md)
        x = self.emb(ids) + positions.unsqueeze(-1).float() * 0.01
        for layer, kv in zip(self.layers, (kv0, kv1), strict=True):
            x = x + layer(x, meta, kv)
        return self.head(x)


def _meta(batch: int, step: int, per_seq: int = 2, new_tokens: int = 1) -> tuple[torch.Tensor, Meta]:
    """Fresh block tables and sequence lengths: the slot mapping differs on every call; the int
    max_seq_len takes two values, so keys repeat and replays happen."""
    gen = torch.Generator().manual_seed(step * 7 + batch)
    tables = torch.randperm(BLOCKS, generator=gen)[: batch * per_seq].view(batch, per_seq)
    lens = torch.randint(new_tokens, per_seq * BLOCK + 1, (batch,), generator=gen)
    pos = (lens.view(batch, 1) - new_tokens + torch.arange(new_tokens)).view(-1)
    seq = torch.arange(batch).repeat_interleave(new_tokens)
    slots = tables[seq, pos // BLOCK] * BLOCK + pos % BLOCK
    return pos, Meta(slots, tables, lens, 8 + step % 2, batch * new_tokens)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def _captures() -> int:
    counts = torch._dynamo.utils.counters["npugraph_ex"]
    return sum(n for key, n in counts.items() if key.startswith("captured_"))


def _compile(fn: Callable[..., Any], dynamic: bool, options: dict[str, Any]) -> Any:
    return torch.compile(fn, backend="npugraph_ex", dynamic=dynamic, options=dict(options) or None)


@pytest.fixture(autouse=True)
def _fresh() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)


OPTIONS = {
    "default": {},
    "clone_input=False": {"clone_input": False},
    "clone_output": {"clone_output": True},
    "frozen_parameter": {"frozen_parameter": True},
}


def _serve(model: PagedModel, compiled: Any, buckets: tuple[int, ...], hold: bool) -> None:
    twin = copy.deepcopy(model)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for step, batch in enumerate(buckets):
            ids = torch.randint(0, VOCAB, (batch,))
            pos, meta = _meta(batch, step)
            got = compiled(ids, pos, meta)
            want = twin(ids.clone(), pos.clone(), copy.deepcopy(meta))
            _close(got, want)
            for a, b in zip(model.caches(), twin.caches(), strict=True):
                _close(a, b)
            if hold:
                kept.append((got, want))
            for old, old_want in kept:
                _close(old, old_want)


@pytest.mark.parametrize(("write", "dynamic", "option"), [
    ("index_copy_", False, "default"), ("index_put_", True, "clone_input=False"),
    ("scatter_", False, "clone_output"), ("index_copy_", True, "frozen_parameter"),
])
def test_paged_cache_with_bucket_order_and_held_outputs_matches_eager(
        write: str, dynamic: bool, option: str) -> None:
    model = PagedModel(write).eval()
    _serve(model, _compile(model, dynamic, OPTIONS[option]), BUCKETS, hold=True)
    assert _captures() > 0


@pytest.mark.parametrize("dynamic", [False, True])
def test_paged_cache_buckets_replay_without_held_outputs(dynamic: bool) -> None:
    model = PagedModel().eval()
    _serve(model, _compile(model, dynamic, {}), BUCKETS, hold=False)
    assert 0 < _captures() < len(BUCKETS)  # later calls of a bucket replayed


def test_two_models_on_one_graph_pool_keep_outputs_across_buckets() -> None:
    pool = graph_pool_handle()
    models = [PagedModel().eval() for _ in range(2)]
    twins = [copy.deepcopy(m) for m in models]
    compiled = [_compile(m, False, {"use_graph_pool": pool}) for m in models]
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for step, (which, batch) in enumerate([(0, 1), (1, 2), (0, 2), (1, 1), (0, 4), (1, 4),
                                               (0, 1), (1, 2)]):
            ids = torch.randint(0, VOCAB, (batch,))
            pos, meta = _meta(batch, step)
            got = compiled[which](ids, pos, meta)
            want = twins[which](ids, pos, copy.deepcopy(meta))
            _close(got, want)
            for a, b in zip(models[which].caches(), twins[which].caches(), strict=True):
                _close(a, b)
            kept.append((got, want))
            for old, old_want in kept:
                _close(old, old_want)
    assert _captures() > 0


@pytest.mark.parametrize("dynamic", [False, True])
def test_dict_metadata_and_caches_as_arguments_match_eager(dynamic: bool) -> None:
    model = DictMetaModel().eval()
    twin = copy.deepcopy(model)
    caches = [torch.zeros(2, BLOCKS * BLOCK, HEADS, HEAD_DIM) for _ in range(2)]
    twin_caches = [c.clone() for c in caches]
    compiled = _compile(model, dynamic, {"clone_input": False})
    with torch.no_grad():
        for step, batch in enumerate((1, 2, 4, 1, 2, 4, 1)):
            ids = torch.randint(0, VOCAB, (batch,))
            pos, meta = _meta(batch, step)
            md = dataclasses.asdict(meta)
            _close(compiled(ids, pos, md, *caches), twin(ids, pos, copy.deepcopy(md), *twin_caches))
            for a, b in zip(caches, twin_caches, strict=True):
                _close(a, b)
    assert _captures() > 0


@pytest.mark.parametrize("sampling", ["argmax", "multinomial"])
def test_prefill_and_decode_graphs_share_the_cache_and_sampled_tokens_feed_back(sampling: str) -> None:
    model = PagedModel().eval()
    twin = copy.deepcopy(model)
    prefill = _compile(model, False, {"clone_output": True})
    decode = _compile(lambda *a: model(*a), True, {"clone_output": True})
    batch, per_seq, prompt = 2, 4, 4
    tables = torch.arange(batch * per_seq).view(batch, per_seq)
    rows = torch.arange(batch)
    with torch.no_grad():
        for _round in range(2):
            ids = torch.randint(0, VOCAB, (batch * prompt,))
            pos = torch.arange(prompt).repeat(batch)
            slots = tables[rows.repeat_interleave(prompt), pos // BLOCK] * BLOCK + pos % BLOCK
            meta = Meta(slots, tables, torch.full((batch,), prompt), 8, batch * prompt)
            got, want = prefill(ids, pos, meta), twin(ids, pos, copy.deepcopy(meta))
            _close(got, want)
            tok = got.view(batch, prompt, VOCAB)[:, -1].argmax(-1)
            twin_tok = tok.clone()
            lens = torch.full((batch,), prompt)
            history: list[tuple[torch.Tensor, torch.Tensor]] = []
            for _step in range(7):
                pos, lens = lens.clone(), lens + 1
                meta = Meta(tables[rows, pos // BLOCK] * BLOCK + pos % BLOCK, tables, lens.clone(), 8,
                            batch)
                got, want = decode(tok, pos, meta), twin(twin_tok, pos.clone(), copy.deepcopy(meta))
                _close(got, want)
                for a, b in zip(model.caches(), twin.caches(), strict=True):
                    _close(a, b)
                history.append((got, want))
                if sampling == "argmax":
                    tok, twin_tok = got.argmax(-1), want.argmax(-1)
                else:
                    state = torch.get_rng_state()
                    tok = torch.multinomial(torch.softmax(got, -1), 1).view(-1)
                    torch.set_rng_state(state)
                    twin_tok = torch.multinomial(torch.softmax(want, -1), 1).view(-1)
                assert torch.equal(tok, twin_tok)
                for old, old_want in history:
                    _close(old, old_want)
            for cache in model.caches() + twin.caches():
                cache.zero_()
    assert _captures() > 0


def test_persistent_input_buffers_passed_as_bucket_views_match_eager() -> None:
    """The engine keeps one buffer per input and passes buf[:batch] after filling it in place."""
    model = PagedModel().eval()
    twin = copy.deepcopy(model)
    compiled = _compile(model, False, {"clone_input": False})
    ids_buf, pos_buf, slot_buf, len_buf = (torch.zeros(8, dtype=torch.long) for _ in range(4))
    table_buf = torch.zeros(8, 2, dtype=torch.long)
    with torch.no_grad():
        for step, batch in enumerate(BUCKETS):
            ids = torch.randint(0, VOCAB, (batch,))
            pos, meta = _meta(batch, step)
            want = twin(ids, pos, meta)
            for buf, src in ((ids_buf, ids), (pos_buf, pos), (slot_buf, meta.slot_mapping),
                             (table_buf, meta.block_tables), (len_buf, meta.seq_lens)):
                buf[:batch].copy_(src)
            views = Meta(slot_buf[:batch], table_buf[:batch], len_buf[:batch], meta.max_seq_len, batch)
            _close(compiled(ids_buf[:batch], pos_buf[:batch], views), want)
            for a, b in zip(model.caches(), twin.caches(), strict=True):
                _close(a, b)
    assert 0 < _captures() < len(BUCKETS)


def test_transformers_llama_decode_interleaves_two_bucket_caches() -> None:
    """One compiled decode step over two batch buckets, each with its own StaticCache, the
    buckets' steps interleaved and every step's logits kept."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    twin = copy.deepcopy(model)
    decode = _compile(model.forward, False, {})
    state: dict[int, list[Any]] = {}
    with torch.no_grad():
        for batch in (1, 4):
            caches = [transformers.StaticCache(config=config, max_batch_size=batch, max_cache_len=32)
                      for _ in range(2)]
            ids = torch.randint(0, 64, (batch, 4))
            firsts = [m(input_ids=ids, past_key_values=c, cache_position=torch.arange(4)).logits
                      for m, c in zip((model, twin), caches, strict=True)]
            state[batch] = [*caches, *(f[:, -1:].argmax(-1) for f in firsts), 4]
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        for batch in (1, 4, 4, 1, 1, 4, 1, 4):
            cache, twin_cache, tok, twin_tok, pos = state[batch]
            at = torch.tensor([pos])
            got = decode(input_ids=tok, past_key_values=cache, cache_position=at).logits
            want = twin(input_ids=twin_tok, past_key_values=twin_cache, cache_position=at).logits
            _close(got, want)
            for a, b in zip(cache.layers, twin_cache.layers, strict=True):
                _close(a.keys, b.keys)
                _close(a.values, b.values)
            kept.append((got, want))
            for old, old_want in kept:
                _close(old, old_want)
            state[batch] = [cache, twin_cache, got[:, -1:].argmax(-1), want[:, -1:].argmax(-1), pos + 1]
    assert _captures() > 0
