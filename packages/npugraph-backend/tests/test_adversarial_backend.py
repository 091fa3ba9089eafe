"""Adversarial cases: torch.compile(backend="npugraph_ex") against eager on real data.

Every compiled function is called at least three times with fresh data (the first call warms up
and captures, later ones replay), and its outputs and every input it may mutate are compared
with eager's."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

CALLS = 3


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, list | tuple):
        return type(x)(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def _compile(fn: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("fullgraph", True)
    kwargs.setdefault("dynamic", False)
    return torch.compile(fn, backend="npugraph_ex", **kwargs)


def _compare(
    eager: Callable[..., Any],
    compiled: Callable[..., Any],
    make_args: Callable[[int], tuple[Any, ...]],
    calls: int = CALLS,
) -> list[Any]:
    """Call both on equal fresh args; outputs and (possibly mutated) args must agree."""
    outs = []
    for i in range(calls):
        args = make_args(i)
        args_e = _clone(args)
        with torch.no_grad():
            got = compiled(*args)
            want = eager(*args_e)
        assert_close(got, want, msg=lambda m, i=i: f"call {i}: {m}")
        assert_close(args, args_e, msg=lambda m, i=i: f"call {i} (inputs after): {m}")
        outs.append(got)
    return outs


def _randn(*shape: int, **kw: Any) -> torch.Tensor:
    return torch.randn(*shape, **kw)


# ---- input mutation ----------------------------------------------------------------------


def test_add_inplace_on_user_input() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * 2

    _compare(f, _compile(f), lambda i: (_randn(3, 4),))


def test_inplace_on_view_of_input() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        x[0].mul_(2)
        return x.sum(0)

    _compare(f, _compile(f), lambda i: (_randn(3, 4),))


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.lin(x) * self.count


def test_buffer_counter_incremented_every_call() -> None:
    m_e = Counter()
    m_c = copy.deepcopy(m_e)
    _compare(m_e, _compile(m_c), lambda i: (_randn(2, 4),), calls=4)
    assert m_c.count.item() == m_e.count.item() == 4


def test_two_inputs_views_of_the_same_base() -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.add_(1)
        return b * 2

    c = _compile(f)
    for _ in range(CALLS):
        base = _randn(8)
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
    for _ in range(CALLS):
        x = _randn(4)
        x_e = x.clone()
        with torch.no_grad():
            got = c(x)
        want = f(x_e)
        assert_close(got, want)
        assert_close(x, x_e)
        assert got.data_ptr() == x.data_ptr()


def test_input_returned_as_is() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x + y

    c = _compile(f)
    for _ in range(CALLS):
        x, y = _randn(4), _randn(4)
        with torch.no_grad():
            a, b = c(x, y)
        assert a is x or a.data_ptr() == x.data_ptr()
        assert_close(b, x + y)


def test_view_of_input_returned() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[1:], x.t()

    c = _compile(f)
    for _ in range(CALLS):
        x = _randn(3, 3)
        with torch.no_grad():
            a, b = c(x)
        assert_close(a, x[1:])
        assert_close(b, x.t())
        x.add_(1)  # eager: views see the caller's later writes
        assert_close(a, x[1:])
        assert_close(b, x.t())


def test_outputs_aliasing_each_other() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        return y, y.view(-1)

    _compare(f, _compile(f), lambda i: (_randn(2, 3),))


def test_outputs_aliasing_each_other_cloned() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        return y, y.view(-1)

    c = _compile(f, options={"clone_output": True})
    _compare(f, c, lambda i: (_randn(2, 3),))


# ---- passes ------------------------------------------------------------------------------


def test_cat_of_mm_outputs_also_used_elsewhere() -> None:
    def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = x @ w1
        b = x @ w2
        c = torch.cat([a, b], dim=1)
        return c, a + 1, b.sum()

    _compare(f, _compile(f), lambda i: (_randn(3, 4), _randn(4, 5), _randn(4, 2)))


def test_cat_of_mm_outputs_then_mutated() -> None:
    def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = x @ w1
        b = x @ w2
        c = torch.cat([a, b], dim=1)
        c.mul_(2)
        return c, a, b

    _compare(f, _compile(f), lambda i: (_randn(3, 4), _randn(4, 5), _randn(4, 2)))


def test_cat_dim1_of_non_contiguous_producers() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = (x * 2).t()
        b = (y + 1).t()
        return torch.cat([a, b], dim=1)

    _compare(f, _compile(f), lambda i: (_randn(3, 4), _randn(5, 4)))


def test_cat_dim0_of_transposed_mm() -> None:
    def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        a = torch.mm(x, w1).t()
        b = torch.mm(x, w2).t()
        return torch.cat([a, b], dim=0) + 0

    _compare(f, _compile(f), lambda i: (_randn(3, 4), _randn(4, 5), _randn(4, 2)))


def test_noop_slice_output_does_not_alias_input() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x[:, :].clone()[0:]

    c = _compile(f)
    for _ in range(CALLS):
        x = _randn(3, 4)
        with torch.no_grad():
            out = c(x)
        assert_close(out, x)
        assert out.data_ptr() != x.data_ptr()
        x.add_(1)
        assert not torch.equal(out, x)


def test_noop_ops_output_is_fresh() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.clone(), x + 0, x * 1, x.to(torch.float32).clone(), torch.pow(x, 1)

    c = _compile(f, options={"clone_output": True})
    for _ in range(CALLS):
        x = _randn(3)
        with torch.no_grad():
            outs = c(x)
        for o in outs:
            assert_close(o, x)
        x.add_(5)
        for o in outs:
            assert not torch.equal(o, x)


def test_pow_one_output() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.pow(x, 1)
        return y, y + x

    c = _compile(f)
    for _ in range(CALLS):
        x = _randn(3)
        with torch.no_grad():
            y, z = c(x)
        assert_close(y, x)
        assert_close(z, 2 * x)
        x.add_(1)
        assert not torch.equal(y, x)


def test_reinplace_old_value_read_later() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x * 2
        b = a.relu()  # candidate for in-place on a...
        c = a + b  # ...but a is read after
        return b, c

    _compare(f, _compile(f), lambda i: (_randn(4, 4),))


def test_reinplace_add_then_read_original() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x + 1
        b = a.add(y)
        c = a.mul(y)
        return b, c

    _compare(f, _compile(f), lambda i: (_randn(4), _randn(4)))


def test_kv_cache_index_copy_read_after_write() -> None:
    def f(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, new)
        return cache.sum(0) + cache.index_select(0, pos).sum()

    def make(i: int) -> tuple[Any, ...]:
        return (_randn(8, 4), torch.tensor([i, i + 2]), _randn(2, 4))

    _compare(f, _compile(f), make)


def test_kv_cache_index_copy_functional_form() -> None:
    def f(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        before = cache.sum()
        cache.copy_(cache.index_copy(0, pos, new))
        return cache * 2 + before

    def make(i: int) -> tuple[Any, ...]:
        return (_randn(8, 4), torch.tensor([i]), _randn(1, 4))

    _compare(f, _compile(f), make)


def test_kv_cache_index_put_read_after_write() -> None:
    def f(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        old = cache.index_select(0, pos)
        cache.index_put_((pos,), new)
        return cache.mean(0) - old.sum()

    def make(i: int) -> tuple[Any, ...]:
        return (_randn(6, 3), torch.tensor([i, 5]), _randn(2, 3))

    _compare(f, _compile(f), make)


def test_kv_cache_scatter_read_after_write() -> None:
    def f(cache: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        pre = cache.clone()
        cache.scatter_(1, idx, src)
        return cache - pre

    def make(i: int) -> tuple[Any, ...]:
        return (_randn(3, 5), torch.randint(0, 5, (3, 1)), _randn(3, 1))

    _compare(f, _compile(f), make)


def test_kv_cache_slice_assign_read_after() -> None:
    def f(k: torch.Tensor, v: torch.Tensor, pos: int, kn: torch.Tensor) -> torch.Tensor:
        k[:, pos] = kn
        v[:, pos] = kn * 2
        return (k * v).sum(-1)

    c = _compile(f)
    for _ in range(CALLS):
        args = (_randn(2, 4, 3), _randn(2, 4, 3), 1, _randn(2, 3))
        args_e = _clone(args)
        with torch.no_grad():
            assert_close(c(*args), f(*args_e))
        assert_close(args, args_e)


# Found here, fixed in the runtime (555959d: integer tensor indexing is captured).
def test_integer_tensor_indexing_of_a_cache() -> None:
    def f(cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return cache[pos] * 2

    _compare(f, _compile(f), lambda i: (_randn(8, 4), torch.tensor([i, i + 2])))


def test_mm_add_broadcast_row() -> None:
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, w) + b

    _compare(f, _compile(f), lambda i: (_randn(3, 4), _randn(4, 5), _randn(5)))


def test_mm_add_broadcast_column() -> None:
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, w) + b

    _compare(f, _compile(f), lambda i: (_randn(3, 4), _randn(4, 5), _randn(3, 1)))


def test_mm_add_result_broadcast_bigger() -> None:
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, w) + b

    _compare(f, _compile(f), lambda i: (_randn(3, 4), _randn(4, 5), _randn(2, 3, 5)))


def test_add_mm_reversed_operands_and_alpha() -> None:
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (b + torch.mm(x, w), torch.add(torch.mm(x, w), b, alpha=2), b - torch.mm(x, w),
                b.add(torch.mm(x, w), alpha=3),
                torch.bmm(x.unsqueeze(0), w.unsqueeze(0)).add(b, alpha=0.5))

    _compare(f, _compile(f), lambda i: (_randn(3, 4), _randn(4, 5), _randn(3, 5)))


def test_bmm_add_broadcast_bias() -> None:
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, w) + b

    for bshape in [(5,), (2, 1, 5), (3, 1), (1, 3, 5)]:
        torch._dynamo.reset()
        _compare(f, _compile(f), lambda i, s=bshape: (_randn(2, 3, 4), _randn(2, 4, 5), _randn(*s)))


def test_linear_chain_with_bias_int_dtype_mix() -> None:
    lin = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    _compare(lin, _compile(lin), lambda i: (_randn(3, 4),))


# Custom ops with a mutable argument reach the graph as auto_functionalized, which no
# device-graph capture can record: it must always be lowered.
@torch.library.custom_op("npugraph_ex_adv::write_rows", mutates_args=("cache",))
def _write_rows(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> None:
    cache.index_copy_(0, pos, new)


@_write_rows.register_fake
def _write_rows_fake(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> None:
    return None


def test_custom_op_writing_an_intermediate_that_is_returned() -> None:
    def f(x: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * 2
        _write_rows(y, pos, new)
        return y, x

    _compare(f, _compile(f), lambda i: (_randn(5, 2), torch.tensor([i]), _randn(1, 2)))


def test_custom_op_writing_a_view_of_an_input() -> None:
    def f(x: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        _write_rows(x[1:], torch.tensor([0]), new)
        return x * 1

    _compare(f, _compile(f), lambda i: (_randn(4, 2), _randn(1, 2)))


def test_custom_op_writing_an_input_without_input_inplace_pass() -> None:
    def f(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        old = cache.sum()
        _write_rows(cache, pos, new)
        return cache.sum(0) + old

    c = _compile(f, options={"input_inplace_pass": False})
    _compare(f, c, lambda i: (_randn(5, 2), torch.tensor([i]), _randn(1, 2)))


# ---- shapes, graphs, modes, dtypes -------------------------------------------------------


def test_dynamic_three_batch_sizes_capture_limit_two() -> None:
    m = nn.Linear(4, 3)
    c = _compile(m, dynamic=True, options={"capture_limit": 2})
    sizes = [2, 3, 5, 2, 5, 3]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _compare(m, c, lambda i: (_randn(sizes[i], 4),), calls=len(sizes))


def test_graph_breaks_several_graphs() -> None:
    def f(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        buf.add_(y)
        torch._dynamo.graph_break()
        z = y.cos() + buf
        torch._dynamo.graph_break()
        return z * 2 + x

    _compare(f, _compile(f, fullgraph=False), lambda i: (_randn(3), _randn(3)))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_and_inference_mode(mode: str) -> None:
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    c = _compile(m)
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    for _ in range(CALLS):
        x = _randn(2, 4)
        with ctx():
            got = c(x)
            want = m(x)
        assert_close(got, want)


def test_inference_mode_then_no_grad_same_model() -> None:
    m = nn.Linear(4, 4)
    c = _compile(m)
    for i in range(4):
        x = _randn(2, 4)
        ctx = torch.inference_mode if i % 2 else torch.no_grad
        with ctx():
            assert_close(c(x), m(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model(dtype: torch.dtype) -> None:
    m = nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 4)).to(dtype)
    _compare(m, _compile(m), lambda i: (_randn(2, 4, dtype=dtype),))


def test_int64_index_input() -> None:
    emb = nn.Embedding(10, 4)

    def f(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return emb(ids) + pos.to(torch.float32).unsqueeze(-1)

    _compare(f, _compile(f), lambda i: (torch.randint(0, 10, (2, 3)), torch.arange(3) + i))


def test_called_with_keyword_arguments() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None,
                    shift: float = 0.0) -> torch.Tensor:
            y = self.lin(x)
            if scale is not None:
                y = y * scale
            return y + shift

    m = M()
    c = _compile(m)
    for _ in range(CALLS):
        x, s = _randn(2, 4), _randn(4)
        with torch.no_grad():
            assert_close(c(x, scale=s, shift=1.5), m(x, scale=s, shift=1.5))
            assert_close(c(scale=s, x=x), m(x, scale=s))


@pytest.mark.parametrize("how", ["new_parameter", "data", "set_"])
def test_parameter_rebound_between_calls(how: str) -> None:
    m = nn.Linear(4, 3)
    c = _compile(m, options={"frozen_parameter": False})
    for _ in range(CALLS + 1):
        x = _randn(2, 4)
        with torch.no_grad():
            assert_close(c(x), m(x))
            new = _randn(3, 4)
            if how == "new_parameter":
                m.weight = nn.Parameter(new)
            elif how == "data":
                m.weight.data = new
            else:
                m.weight.set_(new)


def test_parameter_updated_in_place_between_calls() -> None:
    m = nn.Linear(4, 3)
    c = _compile(m)
    for _ in range(CALLS):
        x = _randn(2, 4)
        with torch.no_grad():
            assert_close(c(x), m(x))
            m.weight.add_(1)


# ---- options -----------------------------------------------------------------------------


def test_shared_graph_pool_two_models_outputs_kept() -> None:
    from npugraph_runtime import graph_pool_handle

    pool = graph_pool_handle("cpu")
    m1 = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    m2 = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    c1 = _compile(m1, options={"use_graph_pool": pool})
    c2 = _compile(m2, options={"use_graph_pool": pool})
    for _ in range(CALLS):
        x = _randn(2, 4)
        with torch.no_grad():
            o1 = c1(x)
            o2 = c2(x)
            assert_close(o1, m1(x))
            assert_close(o2, m2(x))


def test_shared_graph_pool_two_models_cloned_outputs_kept() -> None:
    from npugraph_runtime import graph_pool_handle

    pool = graph_pool_handle("cpu")
    m1 = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    m2 = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    opts = {"use_graph_pool": pool, "clone_output": True}
    c1 = _compile(m1, options=opts)
    c2 = _compile(m2, options=opts)
    kept = []
    for _ in range(CALLS):
        x = _randn(2, 4)
        with torch.no_grad():
            o1, o2 = c1(x), c2(x)
            kept.append((o1, m1(x), o2, m2(x)))
    for o1, w1, o2, w2 in kept:
        assert_close(o1, w1)
        assert_close(o2, w2)


def test_kept_outputs_stay_valid_with_clone_output_false_and_true() -> None:
    m = nn.Linear(4, 4)
    for clone in (False, True):
        torch._dynamo.reset()
        c = _compile(m, options={"clone_output": clone})
        xs = [_randn(2, 4) for _ in range(4)]
        with torch.no_grad():
            outs = [c(x) for x in xs]
            want = [m(x) for x in xs]
        # call 0 is the capture (its result cloned); later calls replay; a result still held when
        # its capture would replay again makes another capture of the key (clone_output=False)
        for o, w in zip(outs, want, strict=True):
            assert_close(o, w)


def test_kv_cache_slice_assign_at_a_dynamic_position() -> None:
    def f(k: torch.Tensor, pos: int, new: torch.Tensor) -> torch.Tensor:
        k[:, pos:pos + 1] = new
        return k[:, :pos + 1].sum(1)

    positions = [2, 3, 5, 4]
    _compare(f, _compile(f, dynamic=True),
             lambda i: (_randn(2, 8, 3), positions[i], _randn(2, 1, 3)), calls=len(positions))


def test_intermediate_slice_assign_at_a_dynamic_position() -> None:
    def f(x: torch.Tensor, pos: int, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        y[:, pos:pos + 1] = new
        return y, y[:, pos:].sum(1)

    positions = [2, 3, 5, 4]
    _compare(f, _compile(f, dynamic=True),
             lambda i: (_randn(2, 8, 3), positions[i], _randn(2, 1, 3)), calls=len(positions))


# Found here, fixed in the runtime (c7cf722: owned input buffers keep the caller's layout).
def test_transposed_user_input_viewed_after_transpose() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.t().reshape(-1) * 2

    _compare(f, _compile(f), lambda i: (_randn(4, 3).t(),))


def test_as_strided_of_a_transposed_user_input() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.as_strided((3,), (1,)) * 2

    _compare(f, _compile(f), lambda i: (_randn(4, 3).t(),))


# Found here, fixed in the runtime (1685920: outputs sharing memory are cloned together).
def test_clone_output_keeps_aliasing_between_outputs() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        return y, y.view(-1)

    c = _compile(f, options={"clone_output": True})
    for _ in range(CALLS):
        with torch.no_grad():
            y, flat = c(_randn(2, 3))
        y.add_(1)
        assert_close(flat, y.view(-1))


# ---- one cache across calls (the replay path of mutated inputs, not the recapture path) -------


def _same_state_calls(
    f: Callable[..., Any], compiled: Callable[..., Any], state: tuple[torch.Tensor, ...],
    make_args: Callable[[int], tuple[Any, ...]], calls: int = 5,
) -> None:
    state_e = _clone(state)
    for i in range(calls):
        args = make_args(i)
        with torch.no_grad():
            got = compiled(*state, *args)
            want = f(*state_e, *_clone(args))
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
                      lambda i: (torch.tensor([i]), _randn(2, 1, 4), _randn(2, 1, 4)))


def test_same_base_of_two_input_views_every_call() -> None:
    def f(base: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return g(base[:6], base[2:], x)

    def g(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        a.mul_(0.5)
        b.add_(x)
        return a + b

    c = _compile(g)
    _same_state_calls(f, lambda base, x: c(base[:6], base[2:], x), (_randn(8),),
                      lambda i: (_randn(6),))


def test_recurrent_state_fed_back_from_the_output() -> None:
    def f(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h.mul_(0.5)
        return torch.tanh(h + x)

    c = _compile(f)
    h = _randn(3)
    h_e = h.clone()
    for i in range(5):
        x = _randn(3)
        with torch.no_grad():
            out = c(x, h)
            want = f(x.clone(), h_e)
        assert_close(out, want, msg=lambda m, i=i: f"call {i}: {m}")
        h, h_e = out, want
