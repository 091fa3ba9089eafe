"""Python ints that only feed values (a decode position in arithmetic, an arange, a mask, an
index tensor built from it) are graph inputs, not graph keys: a new value is a replay, not a
capture. An int that determines a shape or a view offset (a slice bound) stays a key, and the
npugraph_ex log says so with the user's source line. Every call is compared with an eager twin
(a deep copy) over many calls with fresh inputs; the graph is rewritten, so float values are
compared with dtype tolerances, dtypes exactly."""

from __future__ import annotations

import copy
import logging
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from npugraph_backend import _compat
from npugraph_backend.logs import LOGGER_NAME
from torch import nn

LEN = 32
DIM = 16
VOCAB = 24


class Layer(nn.Module):
    """One attention layer of a decoder step over a fixed-length KV cache written at ``pos``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.o = nn.Linear(DIM, DIM)
        self.register_buffer("kc", torch.zeros(LEN, DIM))
        self.register_buffer("vc", torch.zeros(LEN, DIM))

    def forward(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        self.kc.index_copy_(0, torch.arange(pos, pos + 1), k)
        self.vc.index_put_((torch.tensor([pos]),), v)
        mask = torch.arange(LEN) <= pos
        scores = (self.kc @ q.squeeze(0)).masked_fill(~mask, float("-inf"))
        return x + self.o(scores.softmax(-1).unsqueeze(0) @ self.vc)


class DecoderStep(nn.Module):
    """Token and position embedding, two layers, logits; ``pos`` is a Python int."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos_emb = nn.Embedding(LEN, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, token: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache_position = torch.tensor([pos])
        x = self.emb(token) + self.pos_emb(cache_position) * (pos % 7 + 1)
        for layer in self.layers:
            x = layer(x, pos)
        return self.head(x), cache_position + 1


def _captures(counter: Callable[[str], int]) -> int:
    return counter("captured_")


def _fallbacks(counter: Callable[[str], int]) -> int:
    return counter("eager_fallback_due_to") + counter("eager_call_due_to")


def _same(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
    # a function of its own: no loop variable keeps an output alive into the next call (a held
    # output makes the next call use the key's other capture)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        torch.testing.assert_close(g, w)


def _decode(options: dict[str, Any] | None = None, positions: range = range(2, 32),
            dynamic: bool | None = True) -> None:
    model = DecoderStep().eval()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="npugraph_ex", dynamic=dynamic, fullgraph=True,
                             options=options or {})
    previous: tuple[Any, Any] | None = None  # held across the next call, as a decode loop does
    with torch.no_grad():
        for pos in positions:
            token = torch.randint(0, VOCAB, (1,))
            got, want = compiled(token, pos), eager(token, pos)
            _same(got, want)
            if previous is not None:  # still the caller's own after this call
                _same(*previous)
            previous = (got, want)
            for a, b in zip(model.buffers(), eager.buffers(), strict=True):
                torch.testing.assert_close(a, b)


def test_position_int_is_a_value_not_a_key(counter: Callable[[str], int]) -> None:
    _decode()
    assert 1 <= _captures(counter) <= 2  # a capture and its held-outputs twin, not one per pos
    assert _fallbacks(counter) == 0


def test_position_int_under_clone_output(counter: Callable[[str], int]) -> None:
    _decode({"clone_output": True})
    assert _captures(counter) == 1
    assert _fallbacks(counter) == 0


def test_position_int_under_clone_input_false(counter: Callable[[str], int]) -> None:
    # the first call's 0-d tensor becomes the capture's buffer; later ones are copied into it
    _decode({"clone_input": False})
    assert 1 <= _captures(counter) <= 2
    assert _fallbacks(counter) == 0


def test_position_int_with_capture_limit_two(counter: Callable[[str], int]) -> None:
    _decode({"capture_limit": 2})
    assert 1 <= _captures(counter) <= 2
    assert _fallbacks(counter) == 0


def test_position_int_made_symbolic_by_automatic_dynamic(
    counter: Callable[[str], int], compiles: Callable[[], int]
) -> None:
    # the first call specialises pos, the second makes it symbolic: two graphs, then replays
    _decode({"capture_limit": 4}, positions=range(2, 22), dynamic=None)
    assert compiles() == 2
    assert _captures(counter) <= 3
    assert _fallbacks(counter) == 0


class ReadAt(nn.Module):
    """A read whose shape (a slice bound) or view offset (a row) is the int."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("kc", torch.randn(LEN, DIM))

    def forward(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        if self.how == "slice":
            seen = self.kc[: pos + 1]
            return (seen @ x).sum() + pos
        return self.kc[pos] * x


@pytest.mark.parametrize(("how", "what", "line"), [
    ("slice", "shape or view offset", "seen = self.kc[: pos + 1]"),
    ("row", "aten.select.int", "return self.kc[pos] * x"),
])
def test_an_int_a_read_depends_on_stays_a_key_and_is_logged(
    how: str, what: str, line: str, caplog: pytest.LogCaptureFixture,
    counter: Callable[[str], int],
) -> None:
    model = ReadAt(how).eval()
    compiled = torch.compile(model, backend="npugraph_ex", dynamic=True, fullgraph=True)
    positions = [3, 9, 3, 17, 9, 5]
    with torch.no_grad(), caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        for pos in positions:
            x = torch.randn(DIM)
            torch.testing.assert_close(compiled(x, pos), model(x, pos))
    assert _captures(counter) >= len(set(positions))  # a key per value, replays of repeats
    assert _captures(counter) <= 2 * len(set(positions))
    kept = [r.getMessage() for r in caplog.records if "stays in the graph key" in r.getMessage()]
    assert kept, [r.getMessage() for r in caplog.records]
    assert what in kept[0]
    assert f"{__file__.rsplit('/', 1)[-1]}:" in kept[0]
    assert line in kept[0]


class RowWrites(nn.Module):
    """``cache[pos] = x``: the write a decode step makes most naturally, into a buffer and into
    a view of one, in another dtype too."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("kv", torch.zeros(2, LEN, DIM))
        self.register_buffer("vc16", torch.zeros(LEN, DIM, dtype=torch.float16))

    def forward(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        self.kv[0][pos] = x
        self.kv[1][pos] = x * 2
        self.vc16[pos] = x
        return self.kv.sum(1) + self.vc16.float().sum(0)


def test_row_write_at_an_int_is_a_value(counter: Callable[[str], int]) -> None:
    model = RowWrites().eval()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="npugraph_ex", dynamic=True, fullgraph=True)
    with torch.no_grad():
        for pos in range(2, 22):
            x = torch.randn(DIM)
            torch.testing.assert_close(compiled(x, pos), eager(x, pos))
            _same(list(model.buffers()), list(eager.buffers()))
    assert 1 <= _captures(counter) <= 2
    assert _fallbacks(counter) == 0


def _promotions(t: torch.Tensor, pos: int) -> tuple[torch.Tensor, ...]:
    outs = (t + pos, t * pos, t > pos, t <= pos, t == pos,
            t.masked_fill(torch.ones_like(t, dtype=torch.bool), pos), t // pos, t % pos, t / pos,
            torch.full((3,), pos), torch.full(t.shape, pos, dtype=t.dtype))
    if t.dtype is torch.bool:  # eager refuses to subtract with a bool tensor
        return outs
    return (*outs, t - pos, pos - t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32, torch.int8,
                                   torch.uint8, torch.int64, torch.bool])
@pytest.mark.parametrize("shape", [(5,), ()], ids=["1d", "0d"])
def test_int_promotes_as_eager(
    dtype: torch.dtype, shape: tuple[int, ...], counter: Callable[[str], int]
) -> None:
    fn = _promotions
    compiled = torch.compile(fn, backend="npugraph_ex", dynamic=True, fullgraph=True)
    with torch.no_grad():
        for pos in range(2, 12):
            t = (torch.randn(shape) * 20).to(dtype) if dtype is not torch.uint8 else \
                torch.randint(0, 60, shape, dtype=dtype)
            _same(compiled(t, pos), fn(t, pos))
    assert 1 <= _captures(counter) <= 2
    assert _fallbacks(counter) == 0


def test_int_returned_as_an_int_stays_a_key(counter: Callable[[str], int]) -> None:
    def fn(t: torch.Tensor, pos: int) -> tuple[torch.Tensor, int]:
        return t + pos, pos + 1

    compiled = torch.compile(fn, backend="npugraph_ex", dynamic=True, fullgraph=True)
    with torch.no_grad():
        for pos in (2, 3, 4, 3):
            t = torch.randn(4)
            got, want = compiled(t, pos), fn(t, pos)
            torch.testing.assert_close(got[0], want[0])
            assert got[1] == want[1]
    assert _compat.counters()  # something was captured or counted
    assert _captures(counter) >= 3


def test_a_saved_graph_keeps_taking_the_int_as_a_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, counter: Callable[[str], int]
) -> None:
    """The compile cache's round trip keeps which inputs are ints passed as tensors."""
    import torch._functorch.config as functorch_config
    from npugraph_backend import CompiledGraph
    from npugraph_backend.serialization import SerializableCompiledGraph, observe_compiled

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch_cache"))

    def fn(t: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        return t * pos + torch.arange(pos, pos + 5), t > pos

    seen: list[CompiledGraph] = []
    compiled = torch.compile(fn, backend="npugraph_ex", dynamic=True, fullgraph=True)
    with functorch_config.patch(bundled_autograd_cache=True), observe_compiled(seen.append), \
            torch.no_grad():
        compiled(torch.randn(5), 3)
    [graph] = seen
    assert graph.value_ints
    on_disk = copy.copy(SerializableCompiledGraph(graph))
    on_disk.prepare_for_serialization()
    loaded = pickle.loads(pickle.dumps(on_disk))
    loaded.post_compile([], None, {})
    assert isinstance(loaded.compiled, CompiledGraph)
    assert loaded.compiled.value_ints == graph.value_ints
    assert loaded.compiled.inputs == graph.inputs
    before = _captures(counter)
    vals = [n.meta["val"] for n in _compat.placeholders(graph.gm)]
    with torch.no_grad():
        for pos in range(2, 12):
            t = torch.randn(5)
            args = [pos if i in graph.value_ints else 5 if isinstance(v, torch.SymInt) else t
                    for i, v in enumerate(vals)]
            _same(loaded.compiled(args), fn(t, pos))
    assert _captures(counter) - before <= 2


def test_two_ints_both_values(counter: Callable[[str], int]) -> None:
    def fn(t: torch.Tensor, pos: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
        where = torch.arange(pos, pos + 4) * stride
        return t * stride + min(pos, 6) - max(pos - stride, 0) // 2, where

    compiled = torch.compile(fn, backend="npugraph_ex", dynamic=True, fullgraph=True)
    with torch.no_grad():
        for pos, stride in [(2, 3), (5, 7), (9, 2), (4, 4), (11, 5), (6, 9)]:
            t = torch.randn(4)
            _same(compiled(t, pos, stride), fn(t, pos, stride))
    assert 1 <= _captures(counter) <= 2
    assert _fallbacks(counter) == 0


def test_kv_cache_slice_assign_at_a_dynamic_position(replays_match_eager: Callable[..., None]) -> None:
    def f(k: torch.Tensor, pos: int, new: torch.Tensor) -> torch.Tensor:
        k[:, pos:pos + 1] = new
        return k[:, :pos + 1].sum(1)

    positions = [2, 3, 5, 4]
    replays_match_eager(f, torch.compile(f, backend="npugraph_ex", fullgraph=True, dynamic=True),
             lambda i: (torch.randn(2, 8, 3), positions[i], torch.randn(2, 1, 3)), calls=len(positions))


def test_intermediate_slice_assign_at_a_dynamic_position(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor, pos: int, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        y[:, pos:pos + 1] = new
        return y, y[:, pos:].sum(1)

    positions = [2, 3, 5, 4]
    replays_match_eager(f, torch.compile(f, backend="npugraph_ex", fullgraph=True, dynamic=True),
             lambda i: (torch.randn(2, 8, 3), positions[i], torch.randn(2, 1, 3)), calls=len(positions))
