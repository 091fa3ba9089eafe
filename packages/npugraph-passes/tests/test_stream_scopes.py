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
