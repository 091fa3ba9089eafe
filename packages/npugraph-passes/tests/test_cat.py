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


def test_inputs_on_another_stream_the_cat_does_not_wait_for_keep_the_cat() -> None:
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


def _two_stream_cat(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The original's smoke test: the inputs of a cat made on two side streams, joined by events."""
    import npugraph_runtime as ngr

    with ngr.stream(_STREAMS[0]):
        a = (x @ w1).relu()
        done1 = ngr.Event("cpu")
        done1.record()
    with ngr.stream(_STREAMS[1]):
        b = (x @ w2).sigmoid()
        done2 = ngr.Event("cpu")
        done2.record()
    done1.wait()
    done2.wait()
    return torch.cat([a, b]) * 2


_STREAMS: list[object] = []


def test_cat_of_inputs_from_two_side_streams_is_written_in_place_and_equals_eager() -> None:
    pytest.importorskip("npugraph_backend")  # the backend sits above this package
    import warnings

    import npugraph_runtime as ngr
    from torch._dynamo.utils import counters

    if not _STREAMS:
        _STREAMS.extend([ngr.Stream("cpu"), ngr.Stream("cpu")])
    seen: list[list[object]] = []

    def post_pass(gm: torch.fx.GraphModule, example_inputs: object, config: object) -> None:
        seen.append([n.target for n in gm.graph.nodes if n.op == "call_function"])

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_two_stream_cat, backend="npugraph_ex", fullgraph=True,
                             options={"post_grad_custom_post_pass": post_pass})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ngr.CrossStreamWarning)  # every cross-stream use has its event
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            args = [torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)]
            torch.testing.assert_close(compiled(*args), _two_stream_cat(*args))
    (targets,) = seen
    assert aten.cat.default not in targets
    assert targets.count(aten.relu.out) == targets.count(aten.sigmoid.out) == 1
    ours = counters["npugraph_ex"]
    captures = sum(v for k, v in ours.items() if k.startswith(("capture_due", "recapture_due")))
    assert captures >= 1 and sum(v for k, v in ours.items() if k.startswith("eager_")) == 0, dict(ours)
    torch._dynamo.reset()


def test_cat_input_on_a_side_stream_after_the_allocation_gets_an_event() -> None:
    import npugraph_runtime  # noqa: F401  (registers torch.ops.npugraph_ex)
    from npugraph_passes.stream_safety import StreamMap

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.sin(), y.cos()])

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(2, 4), torch.randn(2, 4))
    graph = gm.graph
    ops = torch.ops.npugraph_ex
    sin = next(n for n in graph.nodes if n.target is aten.sin.default)
    cat = next(n for n in graph.nodes if n.target is aten.cat.default)
    with graph.inserting_before(sin):
        graph.call_function(ops.scope_enter.default, (["_user_stream_label"], ["side"]))
    with graph.inserting_after(sin):
        token = graph.call_function(ops.record.default, ())
    with graph.inserting_after(token):
        graph.call_function(ops.scope_exit.default, ())
    with graph.inserting_before(cat):
        graph.call_function(ops.wait.default, ([token],))
    remove_cat_ops(gm, [], None)
    graph.lint()
    counts = _counts(gm)
    assert counts[aten.cat.default] == 0 and counts[aten.sin.out] == 1
    # the side stream waits for the buffer's allocation on the default stream before writing it,
    # and the default stream's write into the buffer waits for the side stream's
    streams = StreamMap(graph)
    empty = next(n for n in graph.nodes if n.target is aten.empty.memory_format)
    side = next(n for n in graph.nodes if n.target is aten.sin.out)
    default = next(n for n in graph.nodes if n.target is aten.cos.out)
    assert streams.label[empty] is None and streams.label[side] == "side" and streams.label[default] is None
    assert streams.ordered(empty, side) and streams.ordered(side, default)
    assert counts[ops.record.default] == 3 and counts[ops.wait.default] == 3
    gm.recompile()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    torch.testing.assert_close(gm(x, y), fn(x, y), rtol=0, atol=0)
