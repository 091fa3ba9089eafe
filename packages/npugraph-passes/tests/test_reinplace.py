"""inplace_pass and input_inplace_pass on real AOT inference graphs (keep_inference_input_mutations)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import npugraph_runtime  # noqa: F401  (registers the npugraph_ex scope/record/wait ops)
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from npugraph_passes._compat import aot_inference_graph
from npugraph_passes.noop import remove_noop_ops
from npugraph_passes.reinplace import inplace_pass, input_inplace_pass
from npugraph_passes.stats import bytes_copied_per_step

# rewritten graphs against the original: nox -s ci reruns them
# under a second kernel variant
pytestmark = pytest.mark.numerics

aten = torch.ops.aten


def _counts(gm: torch.fx.GraphModule) -> Counter[object]:
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def _input_copies(gm: torch.fx.GraphModule) -> int:
    return sum(
        1 for n in gm.graph.nodes
        if n.target is aten.copy_.default and n.args[0].op == "placeholder"
    )


def _compare(gm: torch.fx.GraphModule, reference: torch.fx.GraphModule, inputs: Sequence[Any]) -> None:
    """Same outputs and same final inputs (mutations) as the unoptimised graph."""
    a = [x.clone() for x in inputs]
    b = [x.clone() for x in inputs]
    expected = reference(*a)
    got = gm(*b)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e)
    for e, g in zip(a, b, strict=True):
        torch.testing.assert_close(g, e)


def _optimise(fn: Callable[..., Any], inputs: Sequence[Any], *passes: Callable[..., None]) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    gm, ex = aot_inference_graph(fn, inputs)
    reference, _ = aot_inference_graph(fn, inputs)
    for p in passes:
        p(gm, ex, None)
    gm.graph.lint()
    gm.recompile()
    _compare(gm, reference, inputs)
    return gm, reference


def test_kv_cache_index_copy_becomes_in_place_and_cache_is_not_copied() -> None:
    def step(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor]:
        cache.index_copy_(2, pos, new)
        return (cache.sum(-1),)

    inputs = [torch.zeros(1, 2, 16, 8), torch.tensor([3]), torch.randn(1, 2, 1, 8)]
    gm, ref = _optimise(step, inputs, input_inplace_pass)
    assert bytes_copied_per_step(ref, inputs) == 1 * 2 * 16 * 8 * 4
    assert _counts(gm)[aten.index_copy_.default] == 1
    assert _counts(gm)[aten.index_copy.default] == 0
    assert _input_copies(gm) == 0
    assert bytes_copied_per_step(gm, inputs) == 0


def test_index_put_scatter_and_add_epilogues_become_in_place() -> None:
    def step(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor]:
        a[idx] = 1.0
        b.scatter_(0, idx[None].expand(1, 4), torch.ones(1, 4))
        c.add_(2.0)
        return (a.sum() + b.sum() + c.sum(),)

    inputs = [torch.zeros(5, 4), torch.zeros(5, 4), torch.zeros(5, 4), torch.tensor([1, 3, 0, 2])]
    gm, _ = _optimise(step, inputs, input_inplace_pass)
    counts = _counts(gm)
    assert counts[aten.index_put_.default] == 1
    assert counts[aten.scatter_.src] == 1
    assert counts[aten.add_.Tensor] == 1
    assert _input_copies(gm) == 0


def test_slice_and_select_assignment_write_through_a_view() -> None:
    def step(a: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        a[2:4] = v
        a[:, 1] = w
        return (a * 2,)

    inputs = [torch.zeros(6, 4), torch.randn(2, 4), torch.randn(6)]
    gm, _ = _optimise(step, inputs, inplace_pass, input_inplace_pass)
    counts = _counts(gm)
    assert counts[aten.slice_scatter.default] == 0
    assert counts[aten.select_scatter.default] == 0
    assert _input_copies(gm) == 0
    assert bytes_copied_per_step(gm, inputs) == (2 * 4 + 6) * 4


def test_writes_into_strided_views_of_one_layer_slice_stay_in_place() -> None:
    # kc[l] is a select of the stacked buffer; [:, p] and [slots, 2:4] index it further, the
    # second through a strided slice whose layout the functional index_put result does not have
    def step(kc: torch.Tensor, p: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor]:
        for layer in range(2):
            kc[layer][:, p] = v
            kc[layer][slots, 2:4] = v[:2]
        return (kc[:, :, :5].sum(),)

    inputs = [torch.zeros(2, 8, 16, 4), torch.tensor([3]), torch.randn(8, 1, 4), torch.tensor([1, 5])]
    gm, ref = _optimise(step, inputs, inplace_pass, input_inplace_pass)
    assert bytes_copied_per_step(ref, inputs) == 2 * 8 * 16 * 4 * 4
    counts = _counts(gm)
    assert counts[aten.index_put_.default] == 4
    assert counts[aten.index_put.default] == counts[aten.slice_scatter.default] == counts[aten.select_scatter.default] == 0
    assert counts[aten.copy_.default] == 0 and bytes_copied_per_step(gm, inputs) == 0


def test_old_value_read_after_the_update_keeps_the_copy() -> None:
    # remove_noop_ops drops the clone, so the graph reads the cache's old value after the
    # functional index_copy: writing the cache in place there would change ``old``.
    def step(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor]:
        old = cache.clone()
        cache.index_copy_(0, pos, new)
        return (old + cache,)

    inputs = [torch.randn(6, 4), torch.tensor([1, 4]), torch.randn(2, 4)]
    gm, _ = _optimise(step, inputs, remove_noop_ops, input_inplace_pass)
    assert _counts(gm)[aten.clone.default] == 0
    assert _counts(gm)[aten.index_copy_.default] == 0
    assert _input_copies(gm) == 1


def test_old_value_read_before_the_update_allows_in_place() -> None:
    def step(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor]:
        old = cache * 3
        cache.index_copy_(0, pos, new)
        return (old + cache,)

    inputs = [torch.randn(6, 4), torch.tensor([1, 4]), torch.randn(2, 4)]
    gm, _ = _optimise(step, inputs, input_inplace_pass)
    assert _counts(gm)[aten.index_copy_.default] == 1
    assert _input_copies(gm) == 0


def test_assignment_from_a_fresh_result_writes_through_out() -> None:
    def step(state: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        state.copy_(x @ w)
        return (state.relu(),)

    inputs = [torch.zeros(3, 5), torch.randn(3, 4), torch.randn(4, 5)]
    gm, _ = _optimise(step, inputs, input_inplace_pass)
    assert _counts(gm)[aten.mm.out] == 1
    assert _input_copies(gm) == 0


def test_result_reading_the_input_is_not_written_through_out() -> None:
    def step(state: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        state.copy_(state @ w)
        return (state.sum(),)

    inputs = [torch.randn(4, 4), torch.randn(4, 4)]
    gm, _ = _optimise(step, inputs, input_inplace_pass)
    assert _counts(gm)[aten.mm.out] == 0
    assert _counts(gm)[aten.mm.default] == 1
    assert _input_copies(gm) == 1


def test_intermediate_with_no_later_reader_is_updated_in_place() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor]:
        a = x * 2
        b = a + 1
        return (b.relu(),)

    gm, _ = _optimise(fn, [torch.randn(8)], inplace_pass)
    counts = _counts(gm)
    assert counts[aten.add_.Tensor] == 1
    assert counts[aten.relu_.default] == 1
    assert counts[aten.mul.Tensor] == 1


def test_intermediate_read_later_or_broadcast_is_not_reinplaced() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x * 2
        b = a + 1
        c = (x * 3) + y  # broadcasts to a bigger shape: cannot write into x * 3
        return b + a, c

    gm, _ = _optimise(fn, [torch.randn(4), torch.randn(3, 4)], inplace_pass)
    counts = _counts(gm)
    assert counts[aten.add.Tensor] == 3 - counts[aten.add_.Tensor]
    assert counts[aten.mul_.Tensor] == 0
    adds = [n for n in gm.graph.nodes if n.target is aten.add_.Tensor]
    # only the final b + a may write into b (b is read by nothing afterwards)
    assert all(n.args[0].name == "add" for n in adds)


def test_graph_input_is_never_reinplaced_by_inplace_pass() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x + 1,)

    gm, ref = _optimise(fn, [torch.randn(4)], inplace_pass)
    assert _counts(gm) == _counts(ref)


def _put_on_side_stream(gm: torch.fx.GraphModule, reader_name: str) -> None:
    """Puts the node named ``reader_name`` on the user stream "side", with no event."""
    graph = gm.graph
    reader = next(n for n in graph.nodes if n.name == reader_name)
    with graph.inserting_before(reader):
        graph.call_function(torch.ops.npugraph_ex.scope_enter.default, (["_user_stream_label"], ["side"]))
    with graph.inserting_after(reader):
        graph.call_function(torch.ops.npugraph_ex.scope_exit.default, ())
    graph.lint()


def _kv_with_side_reader() -> tuple[torch.fx.GraphModule, list[Any], Callable[..., Any]]:
    def step(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summary = cache.amax()
        cache.index_copy_(0, pos, new)
        return summary, cache.sum()

    inputs = [torch.randn(6, 4), torch.tensor([1]), torch.randn(1, 4)]
    gm, _ = aot_inference_graph(step, inputs)
    return gm, inputs, step


def test_side_stream_reader_without_event_blocks_input_reinplace() -> None:
    gm, inputs, _ = _kv_with_side_reader()
    _put_on_side_stream(gm, "amax")
    input_inplace_pass(gm, inputs, None)
    assert _input_copies(gm) == 1
    assert _counts(gm)[aten.index_copy_.default] == 0


def test_side_stream_reader_of_another_layer_blocks_a_layer_view_reinplace() -> None:
    # one stacked buffer: a side stream reading layer 1 with no event may run while layer 0's
    # rows are written -- it reads the same storage, so the write stays where it was
    def step(kc: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summary = kc[1].amax()
        kc[0].index_put_((slots,), new)
        return summary, kc.sum()

    inputs = [torch.randn(2, 6, 4), torch.tensor([1, 4]), torch.randn(2, 4)]
    gm, _ = aot_inference_graph(step, inputs)
    plain, _ = aot_inference_graph(step, inputs)
    input_inplace_pass(plain, inputs, None)
    assert _counts(plain)[aten.index_put_.default] == 1  # on one stream it is written in place
    _put_on_side_stream(gm, "amax")
    input_inplace_pass(gm, inputs, None)
    assert _counts(gm)[aten.index_put_.default] == 0
    assert _counts(gm)[aten.index_put.default] == 1


def test_side_stream_reader_ordered_by_event_allows_input_reinplace() -> None:
    gm, inputs, _ = _kv_with_side_reader()
    graph = gm.graph
    reader = next(n for n in graph.nodes if n.name == "amax")
    ops = torch.ops.npugraph_ex
    with graph.inserting_before(reader):
        graph.call_function(ops.scope_enter.default, (["_user_stream_label"], ["side"]))
    with graph.inserting_after(reader):
        rec = graph.call_function(ops.record.default, ())
    with graph.inserting_after(rec):
        exit_node = graph.call_function(ops.scope_exit.default, ())
    with graph.inserting_after(exit_node):
        graph.call_function(ops.wait.default, ([rec],))
    graph.lint()
    reference = torch.fx.GraphModule(gm, graph.__deepcopy__())
    input_inplace_pass(gm, inputs, None)
    gm.recompile()
    assert _input_copies(gm) == 0
    assert _counts(gm)[aten.index_copy_.default] == 1
    _compare(gm, reference, inputs)


@torch.library.custom_op("npugraph_passes_test::update_cache", mutates_args=("cache",))
def update_cache(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> None:
    cache.index_copy_(0, pos, new)


@update_cache.register_fake
def _(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> None:
    return None


MUTATIONS = ["index_copy", "add", "slice", "index_put", "read_old", "mul_out", "scatter", "custom"]


@settings(max_examples=25, deadline=None)
@given(steps=st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=5), read_at_end=st.booleans())
def test_generated_mutation_chains_match_the_functional_graph(steps: list[str], read_at_end: bool) -> None:
    def fn(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = []
        for s in steps:
            if s == "index_copy":
                cache.index_copy_(0, pos, new)
            elif s == "add":
                cache.add_(new.sum())
            elif s == "slice":
                cache[1:3] = new * 0.5
            elif s == "index_put":
                cache[pos] = new + 1
            elif s == "read_old":
                outs.append(cache * 1.5)
            elif s == "mul_out":
                cache.copy_(new.sum(0) * torch.ones_like(cache))
            elif s == "scatter":
                cache.scatter_(0, pos[:, None].expand(2, 4), new)
            elif s == "custom":
                torch.ops.npugraph_passes_test.update_cache(cache, pos, new * 3)
        if read_at_end:
            outs.append(cache.sum(0))
        return (*outs, new * 2)

    inputs = [torch.randn(6, 4), torch.tensor([4, 1]), torch.randn(2, 4)]
    # the production order: no-op removal first, then the two re-inplacing passes
    gm, ref = _optimise(fn, inputs, remove_noop_ops, inplace_pass, input_inplace_pass)
    before, after = _counts(ref), _counts(gm)
    # Only mutations change: compute ops that are not re-inplaced keep their counts (repeats
    # of one op on an unwritten input, `new.sum()` twice, may merge into one).
    untouched = {aten.sum.default, aten.sum.dim_IntList}
    for target in untouched:
        assert after[target] == before[target] or 1 <= after[target] < before[target]
    assert _input_copies(gm) <= _input_copies(ref)


@pytest.mark.parametrize("passes", [(inplace_pass,), (input_inplace_pass,)])
def test_passes_leave_graphs_without_meta_alone(passes: tuple[Callable[..., None], ...]) -> None:
    gm = torch.fx.symbolic_trace(lambda x: (x * 2) + 1)
    before = _counts(gm)
    for p in passes:
        p(gm, [], None)
    assert _counts(gm) == before


def test_returned_update_never_becomes_the_input_itself() -> None:
    # remove_noop_ops drops the clone: the functional result is returned. Writing it into the
    # cache would return the cache itself, which the next step overwrites.
    def step(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor]:
        cache.index_copy_(0, pos, new)
        return (cache.clone(),)

    inputs = [torch.randn(6, 4), torch.tensor([2]), torch.randn(1, 4)]
    gm, _ = _optimise(step, inputs, remove_noop_ops, inplace_pass, input_inplace_pass)
    args = [t.clone() for t in inputs]
    (out,) = gm(*args)
    assert out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr()
    torch.testing.assert_close(out, args[0])


def test_several_updates_of_one_input_become_in_place_without_inplace_pass() -> None:
    def step(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor]:
        cache.index_copy_(0, pos, new)
        cache.index_copy_(0, pos + 1, new * 2)
        cache.mul_(0.5)
        return (cache.sum(),)

    inputs = [torch.randn(6, 4), torch.tensor([0, 2]), torch.randn(2, 4)]
    gm, _ = _optimise(step, inputs, input_inplace_pass)
    counts = _counts(gm)
    assert counts[aten.index_copy_.default] == 2
    assert counts[aten.mul_.Tensor] == 1
    assert _input_copies(gm) == 0


def test_view_of_a_dropped_copy_still_counts_as_reading_the_input() -> None:
    # remove_noop_ops drops cat([cache]); the slice taken of it is then a view of the cache
    # (its meta still describes the dropped copy). It is read after the update, so the update
    # must stay functional.
    def step(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.cat([cache])[1:]
        cache.index_copy_(0, pos, new)
        return window * 2, cache.sum()

    inputs = [torch.randn(6, 4), torch.tensor([3]), torch.randn(1, 4)]
    gm, _ = _optimise(step, inputs, remove_noop_ops, inplace_pass, input_inplace_pass)
    assert _counts(gm)[aten.cat.default] == 0
    assert _counts(gm)[aten.index_copy_.default] == 0


def test_custom_op_mutating_the_cache_writes_it_directly() -> None:
    def step(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor]:
        torch.ops.npugraph_passes_test.update_cache(cache, pos, new * 2)
        return (cache.sum(0),)

    inputs = [torch.randn(6, 4), torch.tensor([1, 4]), torch.randn(2, 4)]
    gm, ref = _optimise(step, inputs, input_inplace_pass)
    assert any("auto_functionalized" in str(t) for t in _counts(ref))
    counts = _counts(gm)
    assert not any("auto_functionalized" in str(t) for t in counts)
    assert counts[torch.ops.npugraph_passes_test.update_cache.default] == 1
    assert counts[aten.clone.default] == 0
    assert _input_copies(gm) == 0


def test_custom_op_cache_read_after_the_update_is_cloned() -> None:
    def step(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        old = cache.clone()
        torch.ops.npugraph_passes_test.update_cache(cache, pos, new)
        return old + cache, cache.sum()

    inputs = [torch.randn(6, 4), torch.tensor([1, 4]), torch.randn(2, 4)]
    gm, _ = _optimise(step, inputs, remove_noop_ops, input_inplace_pass)
    assert _counts(gm)[torch.ops.npugraph_passes_test.update_cache.default] == 0
    assert _input_copies(gm) == 1


def test_custom_op_on_an_intermediate_skips_the_clone() -> None:
    def step(x: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor]:
        buf = x * 2
        torch.ops.npugraph_passes_test.update_cache(buf, pos, new)
        return (buf.relu(),)

    inputs = [torch.randn(6, 4), torch.tensor([1, 4]), torch.randn(2, 4)]
    gm, _ = _optimise(step, inputs, input_inplace_pass)
    counts = _counts(gm)
    assert counts[torch.ops.npugraph_passes_test.update_cache.default] == 1
    assert counts[aten.clone.default] == 0


# inplace_pass never writes into memory that a view (of any alias op, not only the listed view
# ops) shares with a returned tensor, after the tensor itself was re-inplaced.
ALIAS_VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "detach": lambda y: y.detach(),
    "split": lambda y: y.split(2)[1],  # one view of split's list of views
}


@pytest.mark.parametrize("view", list(ALIAS_VIEWS))
def test_op_on_a_view_of_a_reinplaced_intermediate_stays_functional(view: str) -> None:
    of = ALIAS_VIEWS[view]

    def step(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, bias: torch.Tensor,
             acc: torch.Tensor) -> tuple[torch.Tensor]:
        y = torch.nn.functional.linear(x, w, b) + bias  # the add is reinplaced into the linear's
        acc.add_(of(y) * 0.1)  # ... so the view reads that memory, which is returned
        return (y,)

    acc_shape = of(torch.empty(4, 16)).shape
    inputs = [torch.randn(4, 16), torch.randn(16, 16), torch.randn(16), torch.randn(16),
              torch.zeros(acc_shape)]
    gm, _ = aot_inference_graph(step, inputs)
    inplace_pass(gm, inputs, None)
    gm.recompile()
    assert aten.mul_.Tensor not in {n.target for n in gm.graph.nodes}
    (got,) = gm(*inputs[:4], inputs[4].clone())
    torch.testing.assert_close(got, step(*inputs[:4], torch.zeros(acc_shape))[0])
