"""Inputs the compiled graph writes in place: a user tensor, a view of one, a module buffer, two
views of one base, a KV cache written by index_copy_/index_put_/scatter_/slice assignment (then
read), a custom op with a mutable argument, the same state tensors passed on every call. Every
call's outputs and every input it may write equal eager's, call after call."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.testing import assert_close


def _compile(fn: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("fullgraph", True)
    kwargs.setdefault("dynamic", False)
    return torch.compile(fn, backend="npugraph_ex", **kwargs)


def test_an_input_written_in_place_equals_eager(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * 2

    replays_match_eager(f, _compile(f), lambda i: (torch.randn(3, 4),))


def test_a_view_of_an_input_written_in_place_equals_eager(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        x[0].mul_(2)
        return x.sum(0)

    replays_match_eager(f, _compile(f), lambda i: (torch.randn(3, 4),))


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.lin(x) * self.count


def test_buffer_counter_incremented_every_call(replays_match_eager: Callable[..., None]) -> None:
    m_e = Counter()
    m_c = copy.deepcopy(m_e)
    replays_match_eager(m_e, _compile(m_c), lambda i: (torch.randn(2, 4),), calls=4)
    assert m_c.count.item() == m_e.count.item() == 4


def test_two_inputs_views_of_the_same_base() -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.add_(1)
        return b * 2

    c = _compile(f)
    for _ in range(3):
        base = torch.randn(8)
        base_e = base.clone()
        with torch.no_grad():
            got = c(base[:6], base[2:])
            want = f(base_e[:6], base_e[2:])
        assert_close(got, want)
        assert_close(base, base_e)


def test_input_mutated_and_returned() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.mul_(3)

    c = _compile(f)
    for _ in range(3):
        x = torch.randn(4)
        x_e = x.clone()
        with torch.no_grad():
            got = c(x)
        want = f(x_e)
        assert_close(got, want)
        assert_close(x, x_e)
        assert got.data_ptr() == x.data_ptr()


def test_kv_cache_index_copy_read_after_write(replays_match_eager: Callable[..., None]) -> None:
    def f(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, new)
        return cache.sum(0) + cache.index_select(0, pos).sum()

    def make(i: int) -> tuple[Any, ...]:
        return (torch.randn(8, 4), torch.tensor([i, i + 2]), torch.randn(2, 4))

    replays_match_eager(f, _compile(f), make)


def test_kv_cache_index_copy_functional_form(replays_match_eager: Callable[..., None]) -> None:
    def f(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        before = cache.sum()
        cache.copy_(cache.index_copy(0, pos, new))
        return cache * 2 + before

    def make(i: int) -> tuple[Any, ...]:
        return (torch.randn(8, 4), torch.tensor([i]), torch.randn(1, 4))

    replays_match_eager(f, _compile(f), make)


def test_kv_cache_index_put_read_after_write(replays_match_eager: Callable[..., None]) -> None:
    def f(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        old = cache.index_select(0, pos)
        cache.index_put_((pos,), new)
        return cache.mean(0) - old.sum()

    def make(i: int) -> tuple[Any, ...]:
        return (torch.randn(6, 3), torch.tensor([i, 5]), torch.randn(2, 3))

    replays_match_eager(f, _compile(f), make)


def test_kv_cache_scatter_read_after_write(replays_match_eager: Callable[..., None]) -> None:
    def f(cache: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        pre = cache.clone()
        cache.scatter_(1, idx, src)
        return cache - pre

    def make(i: int) -> tuple[Any, ...]:
        return (torch.randn(3, 5), torch.randint(0, 5, (3, 1)), torch.randn(3, 1))

    replays_match_eager(f, _compile(f), make)


def test_kv_cache_slice_assign_read_after() -> None:
    def f(k: torch.Tensor, v: torch.Tensor, pos: int, kn: torch.Tensor) -> torch.Tensor:
        k[:, pos] = kn
        v[:, pos] = kn * 2
        return (k * v).sum(-1)

    c = _compile(f)
    for _ in range(3):
        args = (torch.randn(2, 4, 3), torch.randn(2, 4, 3), 1, torch.randn(2, 3))
        args_e = copy.deepcopy(args)
        with torch.no_grad():
            assert_close(c(*args), f(*args_e))
        assert_close(args, args_e)


# Fixed in the runtime (555959d: integer tensor indexing is captured).
def test_integer_tensor_indexing_of_a_cache(replays_match_eager: Callable[..., None]) -> None:
    def f(cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return cache[pos] * 2

    replays_match_eager(f, _compile(f), lambda i: (torch.randn(8, 4), torch.tensor([i, i + 2])))


# Custom ops with a mutable argument reach the graph as auto_functionalized, which no
# device-graph capture can record: it must always be lowered.
@torch.library.custom_op("npugraph_ex_test_mutated::write_rows", mutates_args=("cache",))
def _write_rows(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> None:
    cache.index_copy_(0, pos, new)


@_write_rows.register_fake
def _write_rows_fake(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> None:
    return None


def test_custom_op_writing_an_intermediate_that_is_returned(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * 2
        _write_rows(y, pos, new)
        return y, x

    replays_match_eager(f, _compile(f), lambda i: (torch.randn(5, 2), torch.tensor([i % 5]),
                                                    torch.randn(1, 2)))


def test_custom_op_writing_a_view_of_an_input(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        _write_rows(x[1:], torch.tensor([0]), new)
        return x * 1

    replays_match_eager(f, _compile(f), lambda i: (torch.randn(4, 2), torch.randn(1, 2)))


def test_custom_op_writing_an_input_without_input_inplace_pass(replays_match_eager: Callable[..., None]) -> None:
    def f(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        old = cache.sum()
        _write_rows(cache, pos, new)
        return cache.sum(0) + old

    c = _compile(f, options={"input_inplace_pass": False})
    replays_match_eager(f, c, lambda i: (torch.randn(5, 2), torch.tensor([i % 5]),
                                                    torch.randn(1, 2)))


# ---- one cache across calls (the replay path of mutated inputs, not the recapture path) -------


def _same_state_calls(
    f: Callable[..., Any], compiled: Callable[..., Any], state: tuple[torch.Tensor, ...],
    make_args: Callable[[int], tuple[Any, ...]], calls: int = 5,
) -> None:
    state_e = copy.deepcopy(state)
    for i in range(calls):
        args = make_args(i)
        with torch.no_grad():
            got = compiled(*state, *args)
            want = f(*state_e, *copy.deepcopy(args))
        assert_close(got, want, msg=lambda m, i=i: f"call {i}: {m}")
        assert_close(state, state_e, msg=lambda m, i=i: f"call {i} (state after): {m}")


def test_same_kv_cache_every_call_written_then_read() -> None:
    def f(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, kn: torch.Tensor,
          vn: torch.Tensor) -> torch.Tensor:
        k.index_copy_(1, pos, kn)
        v.index_copy_(1, pos, vn)
        att = (k * kn.sum(1, keepdim=True)).sum(-1).softmax(-1)
        return (att.unsqueeze(-1) * v).sum(1)

    _same_state_calls(f, _compile(f), (torch.zeros(2, 6, 4), torch.zeros(2, 6, 4)),
                      lambda i: (torch.tensor([i]), torch.randn(2, 1, 4), torch.randn(2, 1, 4)))


def test_same_base_of_two_input_views_every_call() -> None:
    def f(base: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return g(base[:6], base[2:], x)

    def g(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        a.mul_(0.5)
        b.add_(x)
        return a + b

    c = _compile(g)
    _same_state_calls(f, lambda base, x: c(base[:6], base[2:], x), (torch.randn(8),),
                      lambda i: (torch.randn(6),))


def test_recurrent_state_fed_back_from_the_output() -> None:
    def f(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h.mul_(0.5)
        return torch.tanh(h + x)

    c = _compile(f)
    h = torch.randn(3)
    h_e = h.clone()
    for i in range(5):
        x = torch.randn(3)
        with torch.no_grad():
            out = c(x, h)
            want = f(x.clone(), h_e)
        assert_close(out, want, msg=lambda m, i=i: f"call {i}: {m}")
        h, h_e = out, want


def _decay(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    state.mul_(0.5).add_(1)
    return x * 2 + state.sum()


@torch.no_grad()
def test_mutated_input_and_a_disjoint_view_of_its_storage(counter: Callable[[str], int]) -> None:
    # two non-overlapping views of one tensor, one written in place: AOT passes them apart (no
    # synthetic base), and the replay must run like eager rather than refuse them
    step = torch.compile(_decay, backend="npugraph_ex")
    for _ in range(6):
        ours = torch.randn(4, 4)
        eager = ours.clone()
        torch.testing.assert_close(step(ours[:2], ours[2:]), _decay(eager[:2], eager[2:]))
        torch.testing.assert_close(ours, eager)
    assert counter("captured_") == 1
