"""No re-inplacing into memory whose elements overlap, or into another layout (issue 10, item 3).

``may_self_overlap`` is checked against brute force; the passes on real AOT graphs refuse the
unsafe rewrites (STFT framing, overlapping ``unfold``/``as_strided``, a strided slice whose
functional result is dense) and still make the safe ones, compared with the unoptimised graph
over several fresh inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import npugraph_runtime  # noqa: F401  (registers the npugraph_ex scope/record/wait ops)
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from npugraph_passes._compat import aot_inference_graph, compiled_inference_graphs
from npugraph_passes.manager import PassManager
from npugraph_passes.overlap import may_self_overlap
from npugraph_passes.reinplace import inplace_pass

# rewritten graphs against the original: nox -s ci reruns them
# under a second kernel variant
pytestmark = pytest.mark.numerics

aten = torch.ops.aten


def _offsets(sizes: Sequence[int], strides: Sequence[int]) -> list[int]:
    offsets = [0]
    for size, stride in zip(sizes, strides, strict=True):
        offsets = [o + i * stride for o in offsets for i in range(size)]
    return offsets


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 7)), min_size=1, max_size=3))
def test_a_layout_said_not_to_overlap_never_does(dims: list[tuple[int, int]]) -> None:
    sizes, strides = [d[0] for d in dims], [d[1] for d in dims]
    t = torch.empty(200).as_strided(sizes, strides)
    offsets = _offsets(sizes, strides)
    if not may_self_overlap(t):
        assert len(set(offsets)) == len(offsets)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_dense_tensors_in_any_dimension_order_do_not_overlap(sizes: list[int], rnd: Any) -> None:
    order = list(range(len(sizes)))
    rnd.shuffle(order)
    t = torch.empty(sizes).permute(order)
    assert not may_self_overlap(t)
    assert not may_self_overlap(t[..., ::2])


def test_overlapping_views_are_recognised() -> None:
    x = torch.empty(40)
    assert may_self_overlap(x.unfold(0, 8, 4))
    assert may_self_overlap(x.as_strided((3, 3), (1, 1)))
    assert may_self_overlap(x[:1].expand(5))
    assert not may_self_overlap(x.unfold(0, 4, 4))
    assert not may_self_overlap(x[:0].view(0, 1).expand(0, 3))


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _passes(fn: Callable[..., Any], inputs: Sequence[torch.Tensor],
            run: Callable[[torch.fx.GraphModule, list[Any]], None] | None = None) -> torch.fx.GraphModule:
    """``fn``'s AOT graph after the passes (every built-in, or ``run``), checked against the
    unoptimised graph on five fresh inputs."""
    gm, example = aot_inference_graph(fn, inputs)
    reference, _ = aot_inference_graph(fn, inputs)
    if run is None:
        PassManager.from_config(object()).run(gm, example, object())
    else:
        run(gm, example)
    gm.graph.lint()
    gm.recompile()
    for seed in range(5):
        torch.manual_seed(seed)
        fresh = [torch.randn_like(x) for x in inputs]
        for e, g in zip(reference(*fresh), gm(*fresh), strict=True):
            torch.testing.assert_close(g, e)
    return gm


def test_stft_framing_is_not_written_into_the_overlapping_frames() -> None:
    def frames(x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (4, 4), mode="reflect").unfold(-1, 8, 4) * window

    gm = _passes(frames, [torch.randn(2, 32), torch.hann_window(8)])
    assert aten.mul.Tensor in _targets(gm) and aten.mul_.Tensor not in _targets(gm)


def test_frames_that_do_not_overlap_are_still_written_in_place() -> None:
    def frames(x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (4, 4), mode="reflect").unfold(-1, 8, 8) * window

    gm = _passes(frames, [torch.randn(2, 32), torch.hann_window(8)])
    assert aten.mul_.Tensor in _targets(gm)


def test_sliding_unfold_of_an_intermediate_is_not_written_in_place() -> None:
    def f(t: torch.Tensor) -> torch.Tensor:
        return t.exp().unfold(0, 3, 1) * 2

    gm = _passes(f, [torch.randn(10)])
    assert aten.mul_.Tensor not in _targets(gm)


def test_overlapping_as_strided_is_not_written_in_place_and_a_dense_one_is() -> None:
    def overlapping(x: torch.Tensor) -> torch.Tensor:
        return x.exp().as_strided((3, 3), (1, 1)).neg()

    def dense(x: torch.Tensor) -> torch.Tensor:
        return x.exp().as_strided((3, 3), (1, 3)).neg()

    assert aten.neg_.default not in _targets(_passes(overlapping, [torch.randn(9)]))
    assert aten.neg_.default in _targets(_passes(dense, [torch.randn(9)]))


def test_as_strided_scatter_through_an_overlapping_view_stays_functional() -> None:
    def f(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return torch.as_strided_scatter(x.exp(), src, (3, 3), (1, 1))

    gm = _passes(f, [torch.randn(9), torch.randn(3, 3)])
    assert aten.as_strided_scatter.default in _targets(gm)


def test_a_dense_result_is_not_put_into_a_strided_slice_that_is_read_by_position() -> None:
    # mul of a strided slice returns dense memory; as_strided then reads it by position.
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.exp()[:, ::2] * 2).as_strided((4,), (1,))

    gm = _passes(f, [torch.randn(3, 8)], run=lambda gm, ex: inplace_pass(gm, ex, None))
    assert aten.mul_.Tensor not in _targets(gm)


def test_transposed_and_sliced_intermediates_are_still_written_in_place() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.exp().t() * 2 + x.sin()[1:].sum()

    gm = _passes(f, [torch.randn(3, 4)], run=lambda gm, ex: inplace_pass(gm, ex, None))
    assert aten.mul_.Tensor in _targets(gm)


def test_symbolic_sizes_decide_overlap_without_guessing() -> None:
    def sliding(x: torch.Tensor) -> torch.Tensor:
        return x.exp().unfold(0, 3, 1) * 2

    def transposed(x: torch.Tensor) -> torch.Tensor:
        return x.exp().t() * 2

    for fn, inputs, in_place in ((sliding, [torch.randn(10)], False), (transposed, [torch.randn(3, 5)], True)):
        (gm, example), = compiled_inference_graphs(fn, inputs, dynamic=True)
        assert any(isinstance(s, torch.SymInt) for n in gm.graph.nodes
                   if isinstance(n.meta.get("val"), torch.Tensor) for s in n.meta["val"].shape)
        inplace_pass(gm, example, None)
        gm.recompile()
        assert (aten.mul_.Tensor in _targets(gm)) is in_place


def test_strides_of_size_one_dimensions_do_not_block_a_rewrite() -> None:
    # The decode step's (batch, heads, 1, dim) views: the stride of the length-1 dimension is
    # arbitrary and places no element.
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.exp().transpose(1, 2) * 2

    gm = _passes(f, [torch.randn(1, 1, 4, 8)], run=lambda gm, ex: inplace_pass(gm, ex, None))
    assert aten.mul_.Tensor in _targets(gm)
