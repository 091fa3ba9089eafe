"""The passes as the backend runs them: what a custom post pass sees through
torch.compile(backend="npugraph_ex") on CPU, and that the compiled results equal eager."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from npugraph_passes import register_replacement
from torch import nn
from torch.testing import assert_close

aten = torch.ops.aten


class Seen:
    """A custom pass that records the call_function targets of every graph it is given."""

    def __init__(self) -> None:
        self.graphs: list[list[object]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
        self.graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])

    def count(self, target: object) -> int:
        return sum(g.count(target) for g in self.graphs)

    def input_copies(self) -> int:
        return sum(1 for g in self.graphs for t in g if t is aten.copy_.default)


def _compile(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    return torch.compile(fn, backend="npugraph_ex", fullgraph=True, dynamic=False, options=options)


def _seeded(*shape: int, seed: int = 3) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _cat_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.sin(), (x @ w).relu()]) * 2


def _cat_inputs(i: int) -> list[torch.Tensor]:
    return [_seeded(3, 4, seed=10 + i), _seeded(4, 4, seed=20 + i)]


@pytest.mark.parametrize("enabled", [True, False])
def test_post_pass_sees_cat_only_when_remove_cat_ops_is_off(
        enabled: bool, replays_match_eager: Callable[..., None], counter: Callable[[str], int]) -> None:
    seen = Seen()
    compiled = _compile(_cat_model, remove_cat_ops=enabled, post_grad_custom_post_pass=seen)
    replays_match_eager(_cat_model, compiled, _cat_inputs)
    assert counter("captured_") >= 1
    assert seen.graphs
    assert seen.count(aten.cat.default) == (0 if enabled else 1)
    if enabled:
        assert seen.count(aten.sin.out) == 1
        assert seen.count(aten.relu.out) == 1


class KVCache(torch.nn.Module):
    """A static KV cache written with index_copy_ each step, read by attention."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 2, 16, 8))
        self.register_buffer("v", torch.zeros(1, 2, 16, 8))
        self.q = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.k.index_copy_(2, pos, x)
        self.v.index_copy_(2, pos, x * 2)
        q = self.q(x)
        return torch.nn.functional.scaled_dot_product_attention(q, self.k, self.v)


def test_kv_cache_post_pass_sees_index_copy_and_no_cache_copy() -> None:
    seen = Seen()
    eager, model = KVCache().eval(), KVCache().eval()
    model.load_state_dict(eager.state_dict())
    compiled = _compile(model, post_grad_custom_post_pass=seen)
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(1, 2, 1, 8)
            pos = torch.tensor([step])
            torch.testing.assert_close(compiled(x, pos), eager(x, pos))
    torch.testing.assert_close(model.k, eager.k)
    torch.testing.assert_close(model.v, eager.v)
    assert seen.count(aten.index_copy_.default) == 2
    assert seen.count(aten.index_copy.default) == 0
    assert seen.input_copies() == 0


def test_kv_cache_keeps_its_copies_when_input_inplace_pass_is_off() -> None:
    seen = Seen()
    model = KVCache().eval()
    compiled = _compile(model, input_inplace_pass=False, post_grad_custom_post_pass=seen)
    with torch.no_grad():
        compiled(torch.randn(1, 2, 1, 8), torch.tensor([0]))
    assert seen.count(aten.index_copy_.default) == 0
    assert seen.input_copies() == 2


def _noop_slice_model(x: torch.Tensor) -> torch.Tensor:
    return x[:, :].relu() + 1


def test_noop_slice_seen_by_pre_pass_is_gone_for_post_pass(
        replays_match_eager: Callable[..., None], counter: Callable[[str], int]) -> None:
    pre, post = Seen(), Seen()
    compiled = _compile(_noop_slice_model, post_grad_custom_pre_pass=pre, post_grad_custom_post_pass=post)
    replays_match_eager(_noop_slice_model, compiled, lambda i: [_seeded(3, 4, seed=i)])
    assert counter("captured_") >= 1
    noop_views = (aten.slice.Tensor, aten.alias.default)
    assert sum(pre.count(t) for t in noop_views) >= 1
    assert sum(post.count(t) for t in noop_views) == 0


def _linear_model(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, w) + b


def _linear_inputs(i: int) -> list[torch.Tensor]:
    return [_seeded(3, 4, seed=30 + i), _seeded(4, 5, seed=40 + i), _seeded(5, seed=50 + i)]


def _search_mm_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b) + c


def _replace_mm_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.addmm(c, a, b)


def _search_swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def _replace_swish(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x)


def _bias_keeps_product(match: Any) -> bool:
    # The user's guarantee: addmm(c, a, b) == mm(a, b) + c only when c broadcasts to the
    # product's shape and has its dtype (the rule is global: every later compile uses it).
    out = match.output_node().meta["val"]
    a, b, c = (match.kwargs[k].meta["val"] for k in ("a", "b", "c"))
    return bool(out.shape == (a.shape[0], b.shape[1]) and out.dtype == a.dtype == b.dtype == c.dtype)


@functools.cache
def _register_user_patterns() -> None:
    # Once per process: registering the same pattern twice is an error (skip_duplicates=False).
    register_replacement(_search_mm_add, _replace_mm_add,
                         [torch.empty(2, 3), torch.empty(3, 4), torch.empty(4)],
                         extra_check=_bias_keeps_product, skip_duplicates=True)
    # Process-global rule: kept to this test's shapes (7 columns) so other tests never see it.
    register_replacement(_search_swish, _replace_swish, [torch.empty(4)],
                         extra_check=lambda m: m.kwargs["x"].meta["val"].shape[-1] == 7, skip_duplicates=True)


@pytest.mark.parametrize("enabled", [True, False])
def test_register_replacement_mm_add_to_addmm_fires_only_with_pattern_fusion(
        enabled: bool, replays_match_eager: Callable[..., None], counter: Callable[[str], int]) -> None:
    _register_user_patterns()
    seen = Seen()
    compiled = _compile(_linear_model, pattern_fusion_pass=enabled, post_grad_custom_post_pass=seen)
    replays_match_eager(_linear_model, compiled, _linear_inputs)
    assert counter("captured_") >= 1
    assert seen.count(aten.addmm.default) == (1 if enabled else 0)
    assert seen.count(aten.mm.default) == (0 if enabled else 1)


def _swish_model(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x) + 1


@pytest.mark.parametrize("enabled", [True, False])
def test_user_pattern_without_builtin_twin_fires_only_with_pattern_fusion(
        enabled: bool, replays_match_eager: Callable[..., None], counter: Callable[[str], int]) -> None:
    _register_user_patterns()
    seen = Seen()
    compiled = _compile(_swish_model, pattern_fusion_pass=enabled, post_grad_custom_post_pass=seen)
    replays_match_eager(_swish_model, compiled, lambda i: [_seeded(3, 7, seed=i)])
    assert counter("captured_") >= 1
    assert seen.count(aten.silu.default) == (1 if enabled else 0)
    assert seen.count(aten.sigmoid.default) == (0 if enabled else 1)


def test_user_pass_error_names_the_pass() -> None:
    def broken(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
        raise ValueError("bad rewrite")

    compiled = _compile(_noop_slice_model, post_grad_custom_post_pass=broken)
    with pytest.raises(Exception, match="post_grad_custom_post_pass") as info, torch.no_grad():
        compiled(torch.randn(3, 4))
    assert "ValueError: bad rewrite" in str(info.value)


@torch.library.custom_op("npugraph_backend_test::write_cache", mutates_args=("cache",))
def write_cache(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> None:
    cache.index_copy_(2, pos, new)


@write_cache.register_fake
def _(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> None:
    return None


class CustomOpCache(torch.nn.Module):
    """A KV cache written by a custom op with a mutable argument (what attention backends do)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 2, 16, 8))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        torch.ops.npugraph_backend_test.write_cache(self.k, pos, x)
        return torch.nn.functional.scaled_dot_product_attention(x, self.k, self.k)


def test_custom_op_cache_is_written_in_place_not_cloned() -> None:
    seen = Seen()
    eager, model = CustomOpCache().eval(), CustomOpCache().eval()
    compiled = _compile(model, post_grad_custom_post_pass=seen)
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(1, 2, 1, 8)
            pos = torch.tensor([step])
            torch.testing.assert_close(compiled(x, pos), eager(x, pos))
    torch.testing.assert_close(model.k, eager.k)
    assert seen.count(torch.ops.npugraph_backend_test.write_cache.default) == 1
    assert seen.count(aten.clone.default) == 0
    assert seen.input_copies() == 0


def test_cat_of_mm_outputs_also_used_elsewhere(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = x @ w1
        b = x @ w2
        c = torch.cat([a, b], dim=1)
        return c, a + 1, b.sum()

    replays_match_eager(f, _compile(f), lambda i: (torch.randn(3, 4), torch.randn(4, 5), torch.randn(4, 2)))


def test_cat_of_mm_outputs_then_mutated(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = x @ w1
        b = x @ w2
        c = torch.cat([a, b], dim=1)
        c.mul_(2)
        return c, a, b

    replays_match_eager(f, _compile(f), lambda i: (torch.randn(3, 4), torch.randn(4, 5), torch.randn(4, 2)))


def test_cat_dim1_of_non_contiguous_producers(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = (x * 2).t()
        b = (y + 1).t()
        return torch.cat([a, b], dim=1)

    replays_match_eager(f, _compile(f), lambda i: (torch.randn(3, 4), torch.randn(5, 4)))


def test_cat_dim0_of_transposed_mm(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        a = torch.mm(x, w1).t()
        b = torch.mm(x, w2).t()
        return torch.cat([a, b], dim=0) + 0

    replays_match_eager(f, _compile(f), lambda i: (torch.randn(3, 4), torch.randn(4, 5), torch.randn(4, 2)))


def test_noop_slice_output_does_not_alias_input() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x[:, :].clone()[0:]

    c = _compile(f)
    for _ in range(3):
        x = torch.randn(3, 4)
        with torch.no_grad():
            out = c(x)
        assert_close(out, x)
        assert out.data_ptr() != x.data_ptr()
        x.add_(1)
        assert not torch.equal(out, x)


def test_noop_ops_output_is_fresh() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.clone(), x + 0, x * 1, x.to(torch.float32).clone(), torch.pow(x, 1)

    c = _compile(f, clone_output=True)
    for _ in range(3):
        x = torch.randn(3)
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
    for _ in range(3):
        x = torch.randn(3)
        with torch.no_grad():
            y, z = c(x)
        assert_close(y, x)
        assert_close(z, 2 * x)
        x.add_(1)
        assert not torch.equal(y, x)


def test_reinplace_old_value_read_later(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x * 2
        b = a.relu()  # candidate for in-place on a...
        c = a + b  # ...but a is read after
        return b, c

    replays_match_eager(f, _compile(f), lambda i: (torch.randn(4, 4),))


def test_reinplace_add_then_read_original(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x + 1
        b = a.add(y)
        c = a.mul(y)
        return b, c

    replays_match_eager(f, _compile(f), lambda i: (torch.randn(4), torch.randn(4)))


def test_mm_add_broadcast_row(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, w) + b

    replays_match_eager(f, _compile(f), lambda i: (torch.randn(3, 4), torch.randn(4, 5), torch.randn(5)))


def test_mm_add_broadcast_column(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, w) + b

    replays_match_eager(f, _compile(f), lambda i: (torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 1)))


def test_mm_add_result_broadcast_bigger(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, w) + b

    replays_match_eager(f, _compile(f), lambda i: (torch.randn(3, 4), torch.randn(4, 5), torch.randn(2, 3, 5)))


def test_add_mm_reversed_operands_and_alpha(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (b + torch.mm(x, w), torch.add(torch.mm(x, w), b, alpha=2), b - torch.mm(x, w),
                b.add(torch.mm(x, w), alpha=3),
                torch.bmm(x.unsqueeze(0), w.unsqueeze(0)).add(b, alpha=0.5))

    replays_match_eager(f, _compile(f), lambda i: (torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 5)))


def test_bmm_add_broadcast_bias(replays_match_eager: Callable[..., None]) -> None:
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, w) + b

    for bshape in [(5,), (2, 1, 5), (3, 1), (1, 3, 5)]:
        torch._dynamo.reset()
        replays_match_eager(f, _compile(f), lambda i, s=bshape: (torch.randn(2, 3, 4), torch.randn(2, 4, 5), torch.randn(*s)))


def test_linear_chain_with_bias_int_dtype_mix(replays_match_eager: Callable[..., None]) -> None:
    lin = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    replays_match_eager(lin, _compile(lin), lambda i: (torch.randn(3, 4),))



class RunningMean(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("mean", torch.zeros(4, 16))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x) + bias
        self.mean.add_(y.detach() * 0.1)
        return y, self.mean


@pytest.mark.parametrize("inplace_pass", [True, False])
@torch.no_grad()
def test_detached_view_of_a_reinplaced_intermediate_is_not_written(
    inplace_pass: bool, counter: Callable[[str], int]
) -> None:
    model = RunningMean().eval()
    twin = copy.deepcopy(model)
    step = torch.compile(model, backend="npugraph_ex", fullgraph=True,
                         options={"inplace_pass": inplace_pass})
    kept = []
    for _ in range(6):
        x, bias = torch.randn(4, 16), torch.randn(16)
        got, mean = step(x, bias)
        want, want_mean = twin(x, bias)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(mean, want_mean)
        kept.append((got, want.clone()))
    for got, want in kept:
        torch.testing.assert_close(got, want)
    assert counter("captured_") >= 1
