"""remove_cat_ops: producers write into a preallocated cat output through out=."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from npugraph_passes.cat import remove_cat_ops
from npugraph_passes.out_variants import out_overload
from torch.fx.experimental.proxy_tensor import make_fx

# rewritten graphs against the original: nox -s ci reruns them
# under a second kernel variant
pytestmark = pytest.mark.numerics

aten = torch.ops.aten


def _counts(gm: torch.fx.GraphModule) -> Counter[object]:
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def _run(fn: Callable[..., object], *inputs: torch.Tensor) -> tuple[Counter[object], Counter[object]]:
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    expected = gm(*inputs)
    before = _counts(gm)
    remove_cat_ops(gm, list(inputs), None)
    gm.graph.lint()
    gm.recompile()
    got = gm(*inputs)
    expected = expected if isinstance(expected, (list, tuple)) else [expected]
    got = got if isinstance(got, (list, tuple)) else [got]
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e)
    return before, _counts(gm)


def test_cat_of_fresh_results_becomes_out_writes() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([x @ w, y.sin(), y.relu()]) * 2

    before, after = _run(fn, torch.randn(3, 4), torch.randn(4, 4), torch.randn(2, 4))
    assert after[aten.cat.default] == 0
    assert after[aten.empty.memory_format] == 1
    assert after[aten.mm.out] == after[aten.sin.out] == after[aten.relu.out] == 1
    assert after[aten.mm.default] == after[aten.sin.default] == 0
    assert after[aten.mul.Tensor] == before[aten.mul.Tensor]


def test_cat_on_inner_dim_with_unit_prefix_is_removed() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.exp(), y.cos()], dim=1)

    _, after = _run(fn, torch.randn(1, 3, 4), torch.randn(1, 2, 4))
    assert after[aten.cat.default] == 0


def test_cat_on_inner_dim_with_strided_slices_is_kept() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.exp(), y.cos()], dim=1)

    before, after = _run(fn, torch.randn(2, 3), torch.randn(2, 5))
    assert after == before


def test_graph_input_in_cat_keeps_it() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, y.relu()])

    before, after = _run(fn, torch.randn(2, 4), torch.randn(2, 4))
    assert after == before


def test_input_used_elsewhere_keeps_it() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x.sin()
        return torch.cat([a, y.relu()]), a + 1

    before, after = _run(fn, torch.randn(2, 4), torch.randn(2, 4))
    assert after == before


def test_view_input_keeps_it() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.sin().t(), y.relu()])

    before, after = _run(fn, torch.randn(4, 2), torch.randn(2, 4))
    assert after == before


def test_type_promotion_keeps_it() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.sin(), y.relu()])

    before, after = _run(fn, torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4))
    assert after == before


PRODUCERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sin": torch.sin,
    "relu": torch.relu,
    "add": lambda t: t + 1,
    "mm": lambda t: t @ torch.ones(t.shape[-1], t.shape[-1]),
    "input": lambda t: t,
    "view": lambda t: t.sin().view(t.shape),
    "shared": lambda t: t.cos(),
}


@settings(max_examples=40, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(sorted(PRODUCERS)), min_size=1, max_size=4),
    rows=st.lists(st.integers(1, 3), min_size=4, max_size=4),
    dim=st.sampled_from([0, 1]),
)
def test_generated_cats_keep_results_and_only_cat_changes(kinds: list[str], rows: list[int], dim: int) -> None:
    def fn(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        parts = [PRODUCERS[k](x) for k, x in zip(kinds, xs, strict=False)]
        extra = [p * 2 for k, p in zip(kinds, parts, strict=True) if k == "shared"]
        return (torch.cat(parts, dim=dim), *extra)

    if dim == 0:
        inputs = [torch.randn(r, 4) for r in rows[: len(kinds)]]
    else:
        inputs = [torch.randn(1, r, 4) for r in rows[: len(kinds)]]
    before, after = _run(fn, *inputs)
    # a 3-D matmul ends in a view (_unsafe_view), which has no out= form
    fresh = ("sin", "relu", "add", "mm") if dim == 0 else ("sin", "relu", "add")
    qualifies = len(kinds) >= 2 and all(k in fresh for k in kinds)
    assert after[aten.cat.default] == (0 if qualifies else 1)
    # every other op is the same op, or its out= overload
    normal: Counter[object] = Counter()
    for target, n in after.items():
        back = next((t for t in before if out_overload(t) is target), target)
        normal[back] += n
    for target, n in before.items():
        if target is not aten.cat.default:
            assert normal[target] == n


def test_inputs_on_another_stream_keep_the_cat() -> None:
    import npugraph_runtime  # noqa: F401  (registers torch.ops.npugraph_ex)

    gm = make_fx(lambda x, y: torch.cat([x.sin(), y.cos()]), tracing_mode="fake")(torch.randn(2, 4), torch.randn(2, 4))
    graph = gm.graph
    sin = next(n for n in graph.nodes if n.target is aten.sin.default)
    with graph.inserting_before(sin):
        graph.call_function(torch.ops.npugraph_ex.scope_enter.default, (["_user_stream_label"], ["side"]))
    with graph.inserting_after(sin):
        graph.call_function(torch.ops.npugraph_ex.scope_exit.default, ())
    before = _counts(gm)
    remove_cat_ops(gm, [], None)
    assert _counts(gm) == before
