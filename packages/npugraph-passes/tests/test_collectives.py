"""Collectives and their waits are ordering points for every pass (issue 11, item 1).

Graphs are traced by torch.compile (dynamo + AOT, as the backend receives them) from real
torch.distributed calls on a one-rank gloo group on 127.0.0.1: one rank is enough for the graph's
shape, and the optimised graph is run against the unoptimised one on that group. The multi-rank
replay tests live in the backend's suite.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import npugraph_runtime  # noqa: F401  (registers the npugraph_ex scope/record/wait ops)
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from npugraph_passes._compat import compiled_inference_graphs
from npugraph_passes.aliasing import node_storage, written_args
from npugraph_passes.collectives import is_collective, is_collective_wait, is_ordering_point
from npugraph_passes.manager import PassManager
from npugraph_passes.noop import remove_noop_ops

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.numerics,  # rewritten graphs against the original, under two kernel variants in CI
]


@pytest.fixture(scope="module", autouse=True)
def gloo_world() -> Iterator[None]:
    if dist.is_initialized():  # another module of the session made one: use it
        yield
        return
    # Port 0: the one rank's store picks a free loopback port itself.
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Options:
    """Every built-in pass on (the manager's defaults)."""


def _optimised(fn: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> tuple[torch.fx.GraphModule, list[Any]]:
    graphs = compiled_inference_graphs(fn, inputs)
    assert len(graphs) == 1, "the collective broke the graph"
    gm, example = graphs[0]
    reference = torch.fx.GraphModule(gm, torch.fx.Graph())
    reference.graph = _copy(gm.graph)
    reference.recompile()
    PassManager.from_config(_Options()).run(gm, example, _Options())
    gm.graph.lint()
    gm.recompile()
    for _ in range(5):
        fresh = [torch.randn_like(x) if isinstance(x, torch.Tensor) else x for x in example]
        a = [x.clone() if isinstance(x, torch.Tensor) else x for x in fresh]
        b = [x.clone() if isinstance(x, torch.Tensor) else x for x in fresh]
        for e, g in zip(reference(*a), gm(*b), strict=True):
            torch.testing.assert_close(g, e)
        for e, g in zip(a, b, strict=True):  # mutated inputs too
            torch.testing.assert_close(g, e)
    return gm, example


def _copy(graph: torch.fx.Graph) -> torch.fx.Graph:
    new = torch.fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


def _calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _collective_memory(gm: torch.fx.GraphModule) -> set[int | None]:
    keys: set[int | None] = set()
    for n in _calls(gm):
        if is_ordering_point(n):
            keys.update(node_storage(a) for a in n.all_input_nodes)
            keys.add(node_storage(n))
    return keys


def _assert_collectives_untouched(gm: torch.fx.GraphModule, *names: str) -> None:
    """Each collective named is there in its functional form, followed by its wait; no node
    writes into the memory of a collective, its inputs or its wait (but AOT's own epilogue)."""
    calls = _calls(gm)
    collectives = [n for n in calls if is_collective(n)]
    assert sorted(str(n.target).split(".")[1] for n in collectives) == sorted(names)
    for node in collectives:
        assert not str(node.target).split(".")[1].endswith("_"), f"{node.target} was made in-place"
        waits = [u for u in node.users if is_collective_wait(u)]
        assert waits, f"{node} lost its wait"
        position = {n: i for i, n in enumerate(gm.graph.nodes)}
        # Nothing reads the collective's result before its wait.
        assert all(position[u] >= position[waits[0]] for u in node.users)
    memory = _collective_memory(gm)
    last_wait = max(i for i, n in enumerate(gm.graph.nodes) if is_collective_wait(n))
    for i, n in enumerate(gm.graph.nodes):
        if is_ordering_point(n) or n.op != "call_function":
            continue
        if n.target is aten.copy_.default and n.args[0].op == "placeholder" and i > last_wait:
            continue  # AOT's epilogue of a mutated input, after the wait: the graph's own write
        for dst in written_args(n):
            assert node_storage(dst) not in memory, f"{n.format_node()} writes into a collective's memory"


def test_functional_all_reduce_stays_functional_and_its_result_is_not_written() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        r = fc.all_reduce(x * 2, "sum", dist.group.WORLD)
        return r + 1

    gm, _ = _optimised(f, [torch.randn(4, 8)])
    _assert_collectives_untouched(gm, "all_reduce")


def test_in_place_dist_all_reduce_of_an_intermediate_stays_functional() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y)
        return (y + 1).relu()

    gm, _ = _optimised(f, [torch.randn(4, 8)])
    _assert_collectives_untouched(gm, "all_reduce")
    # The rest of the graph is still re-inplaced: relu writes into the add's fresh result.
    assert aten.relu_.default in {n.target for n in _calls(gm)}


def test_in_place_dist_all_reduce_of_an_input_keeps_its_epilogue() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x.sum(-1)

    gm, _ = _optimised(f, [torch.randn(4, 8)])
    _assert_collectives_untouched(gm, "all_reduce")
    copies = [n for n in _calls(gm) if n.target is aten.copy_.default]
    assert len(copies) == 1 and copies[0].args[0].op == "placeholder"
    assert is_collective_wait(copies[0].args[1])


def test_functional_broadcast_stays_functional() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = fc.broadcast(x.exp(), 0, dist.group.WORLD)
        return y.relu()

    gm, _ = _optimised(f, [torch.randn(3, 5)])
    _assert_collectives_untouched(gm, "broadcast")


def test_input_of_a_collective_is_not_written_while_the_collective_may_read_it() -> None:
    # all_gather reads its input asynchronously until the wait: ``y.neg()`` must not become
    # ``neg_(y)`` although nothing reads ``y`` afterwards.
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        g = fc.all_gather_tensor(y, 0, dist.group.WORLD)
        return y.neg(), g

    gm, _ = _optimised(f, [torch.randn(4, 8)])
    _assert_collectives_untouched(gm, "all_gather_into_tensor")
    assert aten.neg_.default not in {n.target for n in _calls(gm)}


def test_cat_of_gathered_and_local_parts_keeps_the_wait_before_its_readers() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        g = fc.all_gather_tensor(y.sin(), 0, dist.group.WORLD)
        return torch.cat([g.relu(), y.neg()])

    gm, _ = _optimised(f, [torch.randn(4, 8)])
    _assert_collectives_untouched(gm, "all_gather_into_tensor")
    # remove_cat_ops still writes both parts into one buffer (the relu after the wait).
    assert aten.cat.default not in {n.target for n in _calls(gm)}


def test_reduce_scatter_and_all_to_all_stay_functional() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = fc.reduce_scatter_tensor(x + 1, "sum", 0, dist.group.WORLD)
        a = fc.all_to_all_single(x * 3, None, None, dist.group.WORLD)
        return r.exp(), a.exp()

    gm, _ = _optimised(f, [torch.randn(4, 8)])
    _assert_collectives_untouched(gm, "all_to_all_single", "reduce_scatter_tensor")


def test_fusion_does_not_span_a_collective() -> None:
    # mm + bias -> addmm would compute the product after the wait: refused. The same pattern
    # with no collective in between is still fused.
    def f(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = torch.mm(a, w)
        b = fc.all_reduce(bias, "sum", dist.group.WORLD)
        local = torch.mm(a, w.neg()) + bias
        return m + b, local

    gm, _ = _optimised(f, [torch.randn(3, 4), torch.randn(4, 5), torch.randn(5)])
    targets = [n.target for n in _calls(gm)]
    assert targets.count(aten.addmm.default) == 1
    assert targets.count(aten.mm.default) == 1
    _assert_collectives_untouched(gm, "all_reduce")


def test_collectives_are_recognised_by_namespace() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    ar = graph.call_function(c10d.all_reduce.default, (x, "sum", "0"))
    wait = graph.call_function(c10d.wait_tensor.default, (ar,))
    add = graph.call_function(aten.add.Tensor, (wait, 1))
    assert is_collective(ar) and not is_collective_wait(ar)
    assert is_collective_wait(wait) and not is_collective(wait)
    assert not is_ordering_point(add) and not is_ordering_point(x)


def test_a_clone_written_by_a_legacy_c10d_collective_is_not_removed() -> None:
    # c10d.allreduce_ writes its tensors with no "!" in its schema; dropping the clone would make
    # it reduce the graph input in place.
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4)
    group, op = graph.placeholder("group"), graph.placeholder("op")
    y = graph.call_function(aten.clone.default, (x,))
    y.meta["val"] = torch.empty(4)
    reduce = graph.call_function(torch.ops.c10d.allreduce_.default, ([y], group, op, None))
    graph.output((y, reduce))
    assert y in written_args(reduce) and is_collective(reduce)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    remove_noop_ops(gm, [], None)
    assert aten.clone.default in {n.target for n in _calls(gm)}


class _RowParallelMLP(torch.nn.Module):
    """Column-parallel gate/up, row-parallel down with an all_reduce, then the residual."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(8, 16, bias=False)
        self.up = torch.nn.Linear(8, 16, bias=False)
        self.down = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))
        dist.all_reduce(out)
        return x + out


def test_tensor_parallel_mlp_keeps_its_all_reduce_and_the_rest_is_still_rewritten() -> None:
    gm, _ = _optimised(_RowParallelMLP().eval(), [torch.randn(2, 3, 8)])
    _assert_collectives_untouched(gm, "all_reduce")
    targets = {n.target for n in _calls(gm)}
    assert {aten.silu_.default, aten.mul_.Tensor} <= targets
