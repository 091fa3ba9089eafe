"""Lowering of stream scopes: nesting checked, side streams forked and joined, graph events."""

from __future__ import annotations

import npugraph_runtime  # noqa: F401  (registers torch.ops.npugraph_ex)
import pytest
import torch
from npugraph_passes.errors import PassError
from npugraph_passes.stream_safety import StreamMap
from npugraph_passes.stream_scopes import lower_stream_scopes

ops = torch.ops.npugraph_ex
aten = torch.ops.aten
CPU = torch.device("cpu")


def _module(build: object) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    build(g, x)  # type: ignore[operator]
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _side_branch(g: torch.fx.Graph, x: torch.fx.Node) -> None:
    g.call_function(ops.scope_enter.default, (["_user_stream_label"], ["side"]))
    y = g.call_function(aten.sin.default, (x,))
    g.call_function(ops.scope_exit.default, ())
    z = g.call_function(aten.cos.default, (x,))
    g.output((y, z))


def test_every_side_stream_is_forked_and_joined() -> None:
    gm = _module(_side_branch)
    assert lower_stream_scopes(gm, CPU, "g")
    nodes = list(gm.graph.nodes)
    sin = next(n for n in nodes if n.target is aten.sin.default)
    output = nodes[-1]
    streams = StreamMap(gm.graph)
    assert sin.meta["stream_label"] == "side"
    # fork: the side stream's op runs after the graph start on the default stream
    first = next(n for n in nodes if n.op == "call_function")
    assert streams.ordered(first, sin)
    # join: the last node before the output is on the default stream and after the side op
    join = output.prev
    assert streams.label[join] is None and streams.ordered(sin, join)
    tags = [n.args[0] for n in nodes if n.target is ops.event_record.default]
    waits = [n.args[0] for n in nodes if n.target is ops.event_wait.default]
    assert sorted(tags) == sorted(waits) and len(tags) == 2 and all(t.startswith("g_") for t in tags)
    enter = next(n for n in nodes if n.target is ops.scope_enter.default)
    assert enter.args == (["_user_stream_label", "_device"], ["side", "cpu"])
    gm.graph.lint()


def test_a_graph_without_scopes_is_left_alone() -> None:
    def build(g: torch.fx.Graph, x: torch.fx.Node) -> None:
        g.output((g.call_function(aten.sin.default, (x,)),))

    gm = _module(build)
    before = len(gm.graph.nodes)
    assert not lower_stream_scopes(gm, CPU, "g")
    assert len(gm.graph.nodes) == before


def test_an_exit_without_enter_raises_naming_the_node() -> None:
    def build(g: torch.fx.Graph, x: torch.fx.Node) -> None:
        g.call_function(ops.scope_exit.default, ())
        g.output((x,))

    with pytest.raises(PassError, match="scope_exit node 'scope_exit_default' has no scope_enter"):
        lower_stream_scopes(_module(build), CPU, "g")


def test_a_tensor_used_on_another_stream_lives_until_the_join() -> None:
    # a graph frees a value once its last use is issued; on a device the side stream may still
    # be reading it, so the lowering moves the last use to the join (record_stream's job)
    def build(g: torch.fx.Graph, x: torch.fx.Node) -> None:
        a = g.call_function(aten.cos.default, (x,))
        g.call_function(ops.scope_enter.default, (["_user_stream_label"], ["side"]))
        b = g.call_function(aten.sin.default, (a,))
        g.call_function(ops.scope_exit.default, ())
        c = g.call_function(aten.exp.default, (x,))
        g.output((b, c))
        for node in (a, b, c):
            node.meta["val"] = torch.empty(3)

    gm = _module(build)
    assert lower_stream_scopes(gm, CPU, "g")
    nodes = list(gm.graph.nodes)
    cos, sin, exp = (next(n for n in nodes if n.target is t)
                     for t in (aten.cos.default, aten.sin.default, aten.exp.default))
    join = nodes[-1].prev
    assert join.target is ops.wait.default
    assert cos in join.args[0]  # made on the default stream, used on the side stream
    # sin goes to the output (the caller holds it); exp stays on the default stream
    assert sin not in join.args[0] and exp not in join.args[0]
    join_line = next(line for line in gm.code.splitlines()
                     if line.strip().startswith(f"{join.name} = "))
    assert f"{cos.name} = " in join_line.split(";", 1)[1]  # freed right after the join
    x = torch.randn(3)
    got = gm(x)
    torch.testing.assert_close(got[0], x.cos().sin())
    torch.testing.assert_close(got[1], x.exp())


def test_a_loaded_graph_gets_its_own_events() -> None:
    from npugraph_passes.stream_scopes import retag_graph_events

    gm = _module(_side_branch)
    lower_stream_scopes(gm, CPU, "graph_1")
    assert retag_graph_events(gm, "graph_1", "graph_7")
    tags = [n.args[0] for n in gm.graph.nodes
            if n.target in (ops.event_record.default, ops.event_wait.default)]
    assert tags and all(t.startswith("graph_7_") for t in tags)
    assert not retag_graph_events(gm, "graph_1", "graph_8")  # nothing left of graph_1
