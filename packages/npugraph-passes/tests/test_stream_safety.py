"""Stream labels and the happens-before order the re-inplacing and fusion passes rely on."""

from __future__ import annotations

import npugraph_runtime  # noqa: F401  (registers torch.ops.npugraph_ex)
import torch
from npugraph_passes.stream_safety import StreamMap

ops = torch.ops.npugraph_ex
aten = torch.ops.aten


def _graph() -> tuple[torch.fx.Graph, dict[str, torch.fx.Node]]:
    """a on "one", then an event to the default stream (b), then one to "two" (c); d runs on
    "one" after its record, with no event to anybody."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.call_function(ops.scope_enter.default, (["_user_stream_label"], ["one"]))
    a = g.call_function(aten.sin.default, (x,))
    r1 = g.call_function(ops.record.default, ())
    d = g.call_function(aten.exp.default, (x,))
    g.call_function(ops.scope_exit.default, ())
    g.call_function(ops.wait.default, ([r1],))
    b = g.call_function(aten.cos.default, (x,))
    r2 = g.call_function(ops.record.default, ())
    g.call_function(ops.scope_enter.default, (["_user_stream_label"], ["two"]))
    g.call_function(ops.wait.default, ([r2],))
    c = g.call_function(aten.relu.default, (x,))
    g.call_function(ops.scope_exit.default, ())
    e = g.call_function(aten.neg.default, (x,))
    g.output((a, b, c, d, e))
    return g, {"a": a, "b": b, "c": c, "d": d, "e": e}


def test_labels_follow_the_scopes() -> None:
    g, n = _graph()
    streams = StreamMap(g)
    assert [streams.label[n[k]] for k in "abcde"] == ["one", None, "two", "one", None]
    assert streams.multi_stream


def test_event_orders_across_streams_and_transitively() -> None:
    g, n = _graph()
    streams = StreamMap(g)
    assert streams.ordered(n["a"], n["b"])
    assert streams.ordered(n["a"], n["c"])  # one -> default -> two
    assert streams.ordered(n["b"], n["c"])


def test_no_event_means_no_order() -> None:
    g, n = _graph()
    streams = StreamMap(g)
    assert not streams.ordered(n["d"], n["b"])  # d runs after the record the default stream waits for
    assert not streams.ordered(n["c"], n["e"])  # the default stream never waits for "two"
    assert streams.ordered(n["b"], n["e"])  # same stream


def test_single_stream_graph_is_always_ordered() -> None:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(aten.sin.default, (x,))
    g.output(y)
    streams = StreamMap(g)
    assert not streams.multi_stream
    assert streams.ordered(x, y)
