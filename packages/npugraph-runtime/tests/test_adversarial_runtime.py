"""Adversarial checks of the runtime against eager on real data: aliasing, layouts, dtypes,
multi-output ops, pools shared between graphs, and the capture manager's input handling.
Each case either matches eager exactly or raises a clear error; none returns a wrong number."""

from __future__ import annotations

import gc
import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

import npugraph_runtime as ngr
import pytest
import torch
import torch.nn.functional as F
from npugraph_runtime.errors import CaptureError, PolicyError

Make = Callable[[], list[Any]]


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(shape)


def _like(t: Any) -> Any:
    """A copy with the same layout (strides) and values; stride-0 views keep their expansion."""
    if not isinstance(t, torch.Tensor):
        return t
    if 0 in t.stride() and t.numel() > 1:
        return t.clone()
    c = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
    return c.copy_(t)


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _flat(v)]
    return [value]


def _assert_same(got: Any, want: Any) -> None:
    got_l, want_l = _flat(got), _flat(want)
    assert len(got_l) == len(want_l)
    for g, w in zip(got_l, want_l, strict=True):
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor) and g.dtype == w.dtype and g.shape == w.shape
            assert torch.equal(g, w), (g, w)
        else:
            assert g == w


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_snapshot(v) for v in value)
    return value


# --- hand capture (Graph / graph) ------------------------------------------------------------------
def _fresh_into(statics: Sequence[Any], make: Make) -> None:
    for s, v in zip(statics, make(), strict=True):
        if isinstance(s, torch.Tensor):
            base = s if s._base is None else s._base
            if 0 in s.stride() and s._base is not None:
                base.copy_(torch.randn_like(base) if base.is_floating_point() else base)
            else:
                s.copy_(v)


def _hand_capture_matches_eager(fn: Callable[..., Any], make: Make, replays: int = 3) -> None:
    statics = make()
    g = ngr.Graph("cpu")
    with ngr.graph(g):
        out = fn(*statics)
    for _ in range(replays):
        _fresh_into(statics, make)
        eager_in = [_like(s) for s in statics]
        want = _snapshot(fn(*eager_in))
        g.replay()
        _assert_same(out, want)
        for s, e in zip(statics, eager_in, strict=True):
            if isinstance(s, torch.Tensor):
                assert torch.equal(s, e)  # in-place effects on inputs match too


def _ints(lo: int, hi: int, *shape: int) -> torch.Tensor:
    return torch.randint(lo, hi, shape)


def _add_to_first_column(x: torch.Tensor) -> torch.Tensor:
    x[:, 0].add_(1)
    return x.sum(1)


def _accumulate_in_place(x: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    x.index_put_((i,), v, accumulate=True)
    return x


_LSTM = torch.nn.LSTM(4, 5, batch_first=True).eval()


@torch.no_grad()
def _lstm(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    out, (h, c) = _LSTM(x)
    return out, h, c


HAND_CASES: dict[str, tuple[Callable[..., Any], Make]] = {
    "outputs_view_the_input": (lambda x: (x[:, 0], x.t(), x * 2), lambda: [_randn(4, 5)]),
    "output_returned_twice": (lambda x: ((y := x + 1), y), lambda: [_randn(4, 5)]),
    "outputs_view_each_other": (lambda x: ((y := x * 3), y[1:], y.t()), lambda: [_randn(4, 5)]),
    "in_place_on_a_view_of_an_input": (_add_to_first_column, lambda: [_randn(4, 5)]),
    "transposed_input": (lambda x: x @ x, lambda: [_randn(5, 5).t()]),
    "expanded_input": (lambda x, y: x + y, lambda: [_randn(4, 1).expand(4, 6), _randn(6)]),
    "int_float_promotion": (
        lambda a, b: (a + b, a * 0.5, a // 3, a / 3),
        lambda: [_ints(-10, 10, 6), _randn(6)],
    ),
    "bfloat16_and_float16": (
        lambda a, b: (a + b, torch.softmax(a, -1), a.half() * b.half()),
        lambda: [_randn(6).bfloat16(), _randn(6).bfloat16()],
    ),
    "bool_masks": (
        lambda a, m: (a.masked_fill(m, -1.0), torch.where(m, a, -a), a * m, torch.where(m, a, 0.0)),
        lambda: [_randn(6), torch.rand(6) > 0.5],
    ),
    "topk_and_max_dim": (
        lambda x: (*torch.topk(x, 3, dim=-1), *x.max(dim=1)),
        lambda: [_randn(4, 8)],
    ),
    "split_and_unbind": (
        lambda x: [t * 2 for t in x.split(3, dim=1)] + list(x.unbind(0)),
        lambda: [_randn(4, 8)],
    ),
    "var_mean_and_native_layer_norm": (
        lambda x, w, b: (*torch.var_mean(x, dim=1), *torch.native_layer_norm(x, (8,), w, b, 1e-5)),
        lambda: [_randn(4, 8), _randn(8), _randn(8)],
    ),
    "zero_dim_tensor_input": (lambda x, s: (x * s, s + 1), lambda: [_randn(4), _randn()]),
    "empty_tensors": (lambda x, y: (x * 2, torch.cat([x, y])), lambda: [_randn(0, 3), _randn(2, 3)]),
    "same_tensor_passed_twice": (lambda a, b: a * b + a, lambda: (lambda t: [t, t])(_randn(5))),
    "non_contiguous_result": (lambda x: (x * 2).t(), lambda: [_randn(3, 4)]),
    "index_put_accumulate": (
        lambda x, i, v: x.index_put((i,), v, accumulate=True),
        lambda: [_randn(6), _ints(0, 6, 10), _randn(10)],
    ),
    "index_put_accumulate_in_place": (
        _accumulate_in_place,
        lambda: [_randn(6), _ints(0, 6, 10), _randn(10)],
    ),
    "scatter_add_and_cumsum": (
        lambda x, i, v: (x.scatter_add(0, i, v), v.cumsum(0), i.cumsum(0)),
        lambda: [_randn(6), _ints(0, 6, 10), _randn(10)],
    ),
    "softmax_and_log_softmax": (
        lambda x: (torch.softmax(x, -1), torch.log_softmax(x, 0)),
        lambda: [_randn(3, 7)],
    ),
    "embedding_and_layer_norm": (
        lambda w, i, g, b: F.layer_norm(F.embedding(i, w), (4,), g, b),
        lambda: [_randn(10, 4), _ints(0, 10, 3, 5), _randn(4), _randn(4)],
    ),
    "conv1d_and_conv2d": (
        lambda x, w, y, v, b: (F.conv1d(x, w, padding=1), F.conv2d(y, v, b, stride=2)),
        lambda: [_randn(2, 3, 10), _randn(4, 3, 3), _randn(2, 3, 9, 9), _randn(4, 3, 3, 3), _randn(4)],
    ),
    "batched_matmul_broadcast": (lambda a, b: a @ b, lambda: [_randn(2, 1, 3, 4), _randn(5, 4, 6)]),
    "int64_arithmetic_and_division": (
        lambda a, b: (
            a * b + 3, a // b, a % b, torch.div(a, b, rounding_mode="trunc"), a >> 1, a / b,
        ),
        lambda: [_ints(-100, 100, 8), _ints(1, 9, 8)],
    ),
    "integer_index_tensors": (
        lambda x, i: (x[i], x[:, i], x[i, i], x[None, i]),
        lambda: [_randn(6, 6), _ints(0, 6, 3)],
    ),
    "lstm_op_with_an_undefined_result": (_lstm, lambda: [_randn(2, 3, 4)]),
    "clamp_with_tensor_bounds": (
        lambda x, lo, hi: x.clamp(lo, hi),
        lambda: [_randn(8), _randn(8) - 1, _randn(8) + 1],
    ),
}


@pytest.mark.parametrize("case", sorted(HAND_CASES))
def test_hand_capture_replays_like_eager(case: str) -> None:
    fn, make = HAND_CASES[case]
    _hand_capture_matches_eager(fn, make)


@pytest.mark.parametrize("case", ["int_float_promotion", "bool_masks", "topk_and_max_dim",
                                  "int64_arithmetic_and_division", "embedding_and_layer_norm"])
def test_capture_on_zero_inputs_replays_like_eager_on_real_data(case: str) -> None:
    """The usual recipe captures on zeros: the kernels chosen at capture must not merely agree
    with eager on those."""
    fn, make = HAND_CASES[case]

    def zeros() -> list[Any]:
        return [torch.zeros_like(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                for t in make()]

    statics = zeros()
    g = ngr.Graph("cpu")
    with ngr.graph(g):
        out = fn(*statics)
    for _ in range(3):
        _fresh_into(statics, make)
        want = _snapshot(fn(*[_like(s) for s in statics]))
        g.replay()
        _assert_same(out, want)


# --- the capture manager ---------------------------------------------------------------------------
MANAGER_CASES = ["outputs_view_the_input", "output_returned_twice", "transposed_input",
                 "expanded_input", "same_tensor_passed_twice", "zero_dim_tensor_input",
                 "empty_tensors", "non_contiguous_result", "topk_and_max_dim"]


@pytest.mark.parametrize("clone_output", [False, True])
@pytest.mark.parametrize("clone_input", [True, False])
@pytest.mark.parametrize("case", MANAGER_CASES)
def test_graphed_callable_matches_eager(case: str, clone_input: bool, clone_output: bool) -> None:
    fn, make = HAND_CASES[case]
    first = make()
    graphed = ngr.make_graphed_callable(fn, first, clone_input=clone_input,
                                        clone_output=clone_output)
    for call in range(4):
        args = first if call == 0 else make()
        want = _snapshot(fn(*[_like(a) for a in args]))
        _assert_same(graphed(*args), want)
    assert graphed.num_captures == 1 and not graphed.fell_back


def test_clone_input_false_same_address_other_strides_is_refused_not_replayed() -> None:
    """Same address and shape, other strides: the old layout must not be replayed, and copying
    base.t() into base would transpose the caller's tensor."""
    base = _randn(4, 4)
    kept = base.clone()
    fn = ngr.make_graphed_callable(lambda x: x.cumsum(1), [base], clone_input=False)
    _assert_same(fn(base), kept.cumsum(1))
    with pytest.raises(PolicyError, match="clone_input=False: input 0's capture buffer"):
        fn(base.t())
    assert torch.equal(base, kept)
    _assert_same(fn(base), kept.cumsum(1))
    other = _randn(4, 4).t()  # another address, transposed: copied into the buffer
    _assert_same(fn(other), other.cumsum(1))


def test_clone_input_false_inputs_aliased_at_capture_then_distinct() -> None:
    t = _randn(5)
    fn = ngr.make_graphed_callable(lambda a, b: a - b, [t, t], clone_input=False)
    _assert_same(fn(t, t), torch.zeros(5))
    u, v = _randn(5), _randn(5)
    _assert_same(fn(u, v), u - v)
    _assert_same(fn(t, t), torch.zeros(5))


def test_clone_input_false_swapped_inputs_are_refused_and_left_intact() -> None:
    a, b = _randn(5), _randn(5)
    kept_a, kept_b = a.clone(), b.clone()
    fn = ngr.make_graphed_callable(lambda x, y: x * 2 - y, [a, b], clone_input=False)
    _assert_same(fn(a, b), kept_a * 2 - kept_b)
    with pytest.raises(PolicyError, match="clone_input=False"):
        fn(b, a)  # refilling either buffer would overwrite the other input of this call
    assert torch.equal(a, kept_a) and torch.equal(b, kept_b)


def test_clone_input_false_overlapping_window_is_refused_disjoint_window_is_copied() -> None:
    big = _randn(20)
    kept = big.clone()
    fn = ngr.make_graphed_callable(lambda x: x * 3 + 1, [big[0:8]], clone_input=False)
    _assert_same(fn(big[0:8]), kept[0:8] * 3 + 1)
    with pytest.raises(PolicyError, match="clone_input=False"):
        fn(big[3:11])
    assert torch.equal(big, kept)
    # a disjoint window is copied into the first call's tensor: the documented caveat
    _assert_same(fn(big[10:18]), kept[10:18] * 3 + 1)
    assert torch.equal(big[8:], kept[8:]) and torch.equal(big[0:8], kept[10:18])


def test_clone_input_true_windows_of_one_tensor_leave_it_intact() -> None:
    big = _randn(8, 8)
    kept = big.clone()
    fn = ngr.make_graphed_callable(lambda x: x.softmax(-1), [big[2:6, 1:5]])
    for r in range(4):
        _assert_same(fn(big[r:r + 4, r + 1:r + 5]), kept[r:r + 4, r + 1:r + 5].softmax(-1))
    assert torch.equal(big, kept)


def test_a_view_of_an_input_fed_back_as_the_next_input() -> None:
    """Outputs that view a user input are views of the caller's tensor (as in eager), never of a
    capture buffer, so feeding them back cannot change them while the buffers are refilled."""
    def rotate(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.t(), x[:2] + y

    x, y = _randn(4, 4), _randn(2, 4)
    fn = ngr.make_graphed_callable(rotate, [x, y])
    ex, ey = x.clone(), y.clone()
    for _ in range(4):
        x, y = fn(x, y)
        ex, ey = rotate(ex, ey)
        _assert_same((x, y), (ex, ey))


def test_clone_input_false_expanded_first_input() -> None:
    def make() -> list[torch.Tensor]:
        return [_randn(4, 1).expand(4, 6), _randn(6)]

    first = make()
    fn = ngr.make_graphed_callable(lambda x, y: x * y, first, clone_input=False)
    for args in (first, make(), make()):
        _assert_same(fn(*args), args[0] * args[1])


def test_clone_input_false_sees_the_same_tensor_mutated_between_calls() -> None:
    x = _randn(4, 4)
    fn = ngr.make_graphed_callable(lambda a: a @ a, [x], clone_input=False)
    for _ in range(3):
        _assert_same(fn(x), x @ x)
        x.mul_(-0.5).add_(1)


@pytest.mark.parametrize("clone_input", [True, False])
def test_undeclared_in_place_write_to_a_user_input_is_refused(clone_input: bool) -> None:
    fn = ngr.make_graphed_callable(_add_to_first_column, [_randn(4, 5)], clone_input=clone_input)
    with pytest.raises(PolicyError, match=r"writes input 0 in place .*aten\.add_.*mutated_argnums"):
        fn(_randn(4, 5))
    assert fn.num_captures == 0


def test_declared_in_place_write_to_an_input_matches_eager() -> None:
    fn = ngr.make_graphed_callable(_add_to_first_column, [_randn(4, 5)], mutated_argnums=(0,))
    for _ in range(3):
        x = _randn(4, 5)
        eager = x.clone()
        want = _add_to_first_column(eager)
        _assert_same(fn(x), want)
        assert torch.equal(x, eager)


def _scale_state(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    state.mul_(2).add_(x)
    return state.sum() + x


def test_undeclared_in_place_write_to_a_static_input_is_refused() -> None:
    """Warmups would apply the write more than once, and the spec promises statics never change."""
    state = _randn(4)
    kept = state.clone()
    fn = ngr.make_graphed_callable(_scale_state, [state, _randn(4)], static_argnums=(0,), warmup=3)
    with pytest.raises(PolicyError, match="writes input 0 in place"):
        fn(state, _randn(4))
    assert not torch.equal(state, kept)  # the eager warmups ran; nothing was captured
    assert fn.num_captures == 0


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_mutated_input_with_warmups_is_written_once_per_call(warmup: int) -> None:
    state = _randn(4)
    eager = state.clone()
    fn = ngr.make_graphed_callable(_scale_state, [state, _randn(4)], mutated_argnums=(0,),
                                   warmup=warmup)
    for _ in range(4):
        x = _randn(4)
        want = _scale_state(eager, x.clone())
        _assert_same(fn(state, x), want)
        assert torch.equal(state, eager)


def test_user_input_sharing_memory_with_a_mutated_input_is_refused() -> None:
    def bump_then_read(cache: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cache.add_(1)
        return x * 2

    t = _randn(5)
    fn = ngr.make_graphed_callable(bump_then_read, [t, t], mutated_argnums=(0,))
    with pytest.raises(PolicyError, match="user input 1 shares memory with mutated input 0"):
        fn(t, t)


def test_nested_outputs_are_cloned_when_clone_output() -> None:
    def nested(a: torch.Tensor) -> tuple[Any, ...]:
        return a * 2, [a + 1, (a - 1, None)], 3

    fn = ngr.make_graphed_callable(nested, [_randn(4)], clone_output=True)
    fn(_randn(4))
    x1 = _randn(4)
    first = fn(x1)
    fn(_randn(4))  # a replay must not overwrite what the previous call returned
    _assert_same(first, nested(x1))
    assert isinstance(first[1], list) and isinstance(first[1][1], tuple)


def test_nested_output_that_is_the_input_is_returned_as_the_input() -> None:
    fn = ngr.make_graphed_callable(lambda a: (a * 2, [a]), [_randn(3)])
    for _ in range(3):
        x = _randn(3)
        got = fn(x)
        assert got[1][0] is x
        _assert_same(got, (x * 2, [x]))


def test_a_dict_inside_the_result_is_refused() -> None:
    fn = ngr.make_graphed_callable(lambda a: (a, {"y": a * 2}), [_randn(3)])
    with pytest.raises(CaptureError, match="returned a dict inside its result"):
        fn(_randn(3))


def test_capture_limit_one_then_new_shapes_run_eagerly_and_keep_old_results() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x.softmax(-1) * 3).cumsum(-1)

    graphed = ngr.make_graphed_callable(fn, [_randn(2, 3)], capture_limit=1)
    kept = None
    with pytest.warns(UserWarning, match="capture_limit=1"):
        for shape in [(2, 3), (2, 3), (4, 3), (2, 3), (5, 5)]:
            x = _randn(*shape)
            got = graphed(x)
            _assert_same(got, fn(x))
            if kept is None:
                kept = (got, got.clone())
    assert graphed.fell_back
    assert kept is not None and torch.equal(*kept)


def test_replay_after_the_callers_locals_died_and_gc() -> None:
    def build() -> tuple[Any, torch.Tensor]:
        weight = _randn(6, 6)
        fn = ngr.make_graphed_callable(lambda x, w: (x @ w).relu(), [_randn(3, 6), weight],
                                       static_argnums=(1,))
        return fn, weight

    fn, weight = build()
    gc.collect()
    for _ in range(3):
        x = _randn(3, 6)
        got = fn(x, weight)
        gc.collect()
        _assert_same(got, (x @ weight).relu())


def test_replay_in_another_thread() -> None:
    weight = _randn(6, 6)
    fn = ngr.make_graphed_callable(lambda x, w: (x @ w).tanh(), [_randn(3, 6), weight],
                                   static_argnums=(1,))
    fn(_randn(3, 6), weight)
    results: list[bool] = []

    def work() -> None:
        for rows in (3, 5):  # one replay, one capture in this thread
            x = _randn(rows, 6)
            results.append(torch.equal(fn(x, weight), (x @ weight).tanh()))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert results == [True, True]


# --- pools -----------------------------------------------------------------------------------------
def _graph_a(x: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ x.t()) * 3
    return h.exp().log1p().sum(0) + 1


def _graph_b(y: torch.Tensor) -> torch.Tensor:
    z = (y * 7).sin()
    return (z.cumsum(0) * z).tanh()


def test_a_graphs_output_survives_another_graph_of_its_pool() -> None:
    pool = ngr.graph_pool_handle("cpu")
    xa, xb = _randn(16, 16), _randn(16, 16)
    ga, gb = ngr.Graph("cpu"), ngr.Graph("cpu")
    with ngr.graph(ga, pool=pool):
        out_a = _graph_a(xa)
    with ngr.graph(gb, pool=pool):
        out_b = _graph_b(xb)
    assert ngr.pool_bytes(pool) > 0
    for _ in range(4):
        xa.copy_(_randn(16, 16))
        xb.copy_(_randn(16, 16))
        ga.replay()
        kept = out_a.clone()
        gb.replay()
        assert torch.equal(out_a, kept)
        _assert_same(out_a, _graph_a(xa))
        _assert_same(out_b, _graph_b(xb))


def _shaped(x: torch.Tensor) -> torch.Tensor:
    return ((x * 2).softmax(-1) @ x.t()).relu().sum(-1)


def test_many_shapes_in_one_pool_replayed_in_random_order_and_after_resets() -> None:
    rng = random.Random(0)
    pool = ngr.graph_pool_handle("cpu")
    graphs = []
    for n in (3, 7, 16, 5, 32, 1):
        x = _randn(n, n + 1)
        g = ngr.Graph("cpu")
        with ngr.graph(g, pool=pool):
            out = _shaped(x)
        graphs.append((g, x, out))

    def replay_some(indices: list[int], times: int) -> None:
        for _ in range(times):
            g, x, out = graphs[rng.choice(indices)]
            x.copy_(torch.randn_like(x))
            g.replay()
            _assert_same(out, _shaped(x))

    replay_some(list(range(6)), 30)
    graphs[1][0].reset()
    graphs[4][0].reset()
    gc.collect()
    replay_some([0, 2, 3, 5], 15)
    for n in (9, 40):  # new captures reuse the pool the resets freed
        x = _randn(n, n + 1)
        g = ngr.Graph("cpu")
        with ngr.graph(g, pool=pool):
            out = _shaped(x)
        graphs.append((g, x, out))
    replay_some([0, 2, 3, 5, 6, 7], 30)


def test_hand_capture_replays_after_its_locals_died_and_in_another_thread() -> None:
    def build() -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        w = _randn(8, 8)
        x = _randn(4, 8)
        g = ngr.Graph("cpu")
        with ngr.graph(g):
            out = (x @ w).relu() + w.sum()
        return g, x, out, w.clone()

    g, x, out, w = build()
    gc.collect()
    for _ in range(2):
        x.copy_(_randn(4, 8))
        g.replay()
        _assert_same(out, (x @ w).relu() + w.sum())
    results: list[bool] = []

    def work() -> None:
        x.copy_(_randn(4, 8))
        g.replay()
        results.append(torch.equal(out, (x @ w).relu() + w.sum()))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert results == [True]


@pytest.mark.parametrize("clone_input", [True, False])
@pytest.mark.parametrize(
    "fn",
    [lambda x: x.t().view(-1) * 2, lambda x: x.as_strided((3,), (1,)) * 2],
    ids=["view_valid_only_for_the_input_layout", "as_strided"],
)
def test_owned_input_buffers_keep_the_callers_layout(
    fn: Callable[[torch.Tensor], torch.Tensor], clone_input: bool
) -> None:
    def make() -> torch.Tensor:
        return _randn(4, 3).t()

    first = make()
    # clone_input=False owns a buffer too when the first tensor shares memory with another input
    args = (first,) if clone_input else (first, first)
    graphed = ngr.make_graphed_callable((lambda x, *_: fn(x)), args, clone_input=clone_input,
                                        static_argnums=() if clone_input else (1,))
    for call in range(3):
        x = first if call == 0 else make()
        _assert_same(graphed(x, *args[1:]), fn(x))


def _outputs_sharing_memory(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    y = x * 2
    return y, y.view(-1), y[1], y.view(torch.int32), x + 1


def test_clone_output_keeps_outputs_that_share_memory_sharing_it() -> None:
    fn = ngr.make_graphed_callable(_outputs_sharing_memory, [_randn(2, 3)], clone_output=True)
    fn(_randn(2, 3))
    for _ in range(2):
        x = _randn(2, 3)
        got, want = fn(x), _outputs_sharing_memory(x)
        _assert_same(got, want)
        got[0].add_(1)  # a write through one output shows through its aliases, as in eager
        want[0].add_(1)
        _assert_same(got, want)
        assert got[0].untyped_storage().data_ptr() != got[4].untyped_storage().data_ptr()


def test_boolean_mask_indexing_is_still_refused() -> None:
    x, g = _randn(8), ngr.Graph("cpu")
    with pytest.raises(CaptureError, match="output shape that depends on the data"), ngr.graph(g):
        _ = x[x > 0] * 2


@pytest.mark.parametrize(
    ("fn", "what"),
    [
        (lambda x: x * x.tolist()[0], r"Tensor\.tolist"),
        (lambda x: x * float(x.numpy()[0]), r"Tensor\.numpy"),
        (lambda x: x * len(repr(x[0])), r"Tensor\.__repr__"),
        (lambda x: x + torch.tensor([x[0], x[1], 0, 0, 0, 0]), r"torch\.tensor\(\) of a list"),
    ],
    ids=["tolist", "numpy", "repr", "tensor_of_elements"],
)
def test_host_reads_that_bypass_dispatch_are_refused(fn: Callable[[torch.Tensor], Any], what: str) -> None:
    """On the CPU these read values without an ATen op: replays would silently repeat them."""
    x = _randn(6)
    kept = x.clone()
    g = ngr.Graph("cpu")
    with pytest.raises(CaptureError, match=what + ".*reads tensor values on the host"), ngr.graph(g):
        fn(x)
    assert torch.equal(x, kept)
    with pytest.raises(CaptureError, match="holds no capture"):
        g.replay()


def test_host_read_in_relaxed_mode_warns_and_repeats_the_captured_value() -> None:
    x = _randn(6)
    first = x.tolist()[0]
    g = ngr.Graph("cpu")
    with pytest.warns(UserWarning, match=r"Tensor\.tolist"), ngr.graph(g, capture_error_mode="relaxed"):
        out = x * x.tolist()[0]
    x.copy_(_randn(6))
    g.replay()
    _assert_same(out, x * first)


def test_a_graph_replayed_inside_another_capture_of_its_pool() -> None:
    """The outer capture records the inner graph's replay, which uses the inner graph's blocks
    of the shared pool: the outer graph's own intermediates must not be placed over them."""
    pool = ngr.graph_pool_handle("cpu")
    inner = ngr.make_graphed_callable(lambda x: (x.sin() * 3).exp().sum(0), [_randn(8, 8)],
                                      pool=pool)

    def outer_fn(y: torch.Tensor) -> torch.Tensor:
        return ((y.cos() * 5) + 1) * inner(y * 2) + y.cos()

    outer = ngr.make_graphed_callable(outer_fn, [_randn(8, 8)], pool=pool)
    for _ in range(4):
        y = _randn(8, 8)
        _assert_same(outer(y), outer_fn(y))


def _scaled(x: torch.Tensor, scale: float, flag: bool, name: str) -> torch.Tensor:
    if name != "a":
        return x + 100
    return x * scale if flag else x - scale


def test_float_and_bool_inputs_select_graphs_and_a_changed_constant_is_refused() -> None:
    fn = ngr.make_graphed_callable(_scaled, [_randn(3), 0.5, True, "a"])
    for scale, flag in [(0.5, True), (0.7, True), (0.5, False), (0.7, True)]:
        x = _randn(3)
        _assert_same(fn(x, scale, flag, "a"), _scaled(x, scale, flag, "a"))
    assert fn.num_captures == 3
    with pytest.raises(PolicyError, match="constant input 3 is 'b' but the graph was captured with 'a'"):
        fn(_randn(3), 0.5, True, "b")


def test_the_capture_write_watch_lets_higher_order_operators_through() -> None:
    """The manager watches writes during captures on every device; on CUDA a graph may hold a
    higher-order operator (torch.cond), which must run as without the watch."""
    from npugraph_runtime.inputs import WriteWatch

    x = _randn(4)
    with WriteWatch({}):
        got = torch.cond(x.sum() > 0, lambda v: v.sin(), lambda v: v.cos(), (x,))
    _assert_same(got, x.sin() if x.sum() > 0 else x.cos())


def _decay_cache(cache: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    cache[:, 0].add_(x)
    cache.mul_(0.5)
    return cache.sum(1) + x


def test_mutated_input_passed_as_a_view_of_a_bigger_tensor() -> None:
    big = _randn(4, 8)
    eager_big = big.clone()
    fn = ngr.make_graphed_callable(_decay_cache, [big[:, 2:6], _randn(4)], mutated_argnums=(0,))
    for call in range(5):
        start = 2 if call < 3 else 1  # a new view (new address) recaptures
        x = _randn(4)
        want = _decay_cache(eager_big[:, start:start + 4], x.clone())
        _assert_same(fn(big[:, start:start + 4], x), want)
        assert torch.equal(big, eager_big)
    assert [e.reason for e in fn.events] == ["new_key", "mutated_input_change"]


def test_an_output_of_one_key_survives_calls_of_other_keys_sharing_the_pool() -> None:
    """CPU graphs never place outputs in the pool: a key's static output changes only when that
    key replays again."""
    fn = ngr.make_graphed_callable(_shaped, [_randn(3, 4)])
    x3 = _randn(3, 4)
    fn(x3)
    out3 = fn(x3)
    kept = out3.clone()
    for rows in (5, 7, 5, 9):
        x = _randn(rows, 4)
        _assert_same(fn(x), _shaped(x))
        assert torch.equal(out3, kept)
    assert fn.num_captures == 4
