"""Lowering of the scope ops of a compiled graph to streams and events of that graph.

Users leave ``npugraph_ex.scope_enter/scope_exit`` (stream and core-limit scopes) and
``npugraph_ex.record()`` / ``npugraph_ex.wait([token])`` pairs in the graph (``npugraph_runtime.stream``,
``Event`` and ``limit_core_num`` do so when traced). :func:`lower_stream_scopes`:

* checks that scopes nest (an exit with nothing open, or a scope left open, raises naming the node);
* marks stream and core-limit scopes with the graph's device, which makes them take effect when
  they run (see ``npugraph_runtime.ops``);
* closes the streams: the graph start is recorded and every side stream waits for it before its
  first node (fork), and the default stream waits for every side stream's last node before the
  output and its mutated-input epilogue (join) -- a device graph whose side stream is not joined
  cannot be captured;
* gives every record/wait pair an event of the graph (``event_record`` / ``event_wait`` with tag
  ``<graph>_<record node>``), next to the markers, which stay for the stream-safety analysis; a
  ``wait([tensor])`` on a computed tensor gets an event recorded right after its producer.

* keeps every tensor used on another stream than the one that made it alive until the join (it
  is an argument of the join's ``wait``): a graph frees a value after its last use *is issued*,
  and a device allocator would hand the memory of a tensor made on one stream to the next
  allocation there while another stream may still read it -- what ``Tensor.record_stream`` is
  for in eager code. After the join every stream's work is ordered before the default stream's.

Each node's stream label (None: the default stream) is left in ``node.meta["stream_label"]``, and
the graph's name and device in ``gm.meta``: :func:`order_streams` gives a later pass's new
record/wait pair its event the same way.
:func:`retag_graph_events` renames a graph's events when a saved graph is loaded under a new
name, so that its events are its own and not those of another graph of the process."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from npugraph_passes.errors import PassError
from npugraph_passes.stream_safety import (
    USER_STREAM_LABEL,
    StreamMap,
    is_record,
    is_scope_enter,
    is_scope_exit,
    is_wait,
)

PASS_NAME = "lower_stream_scopes"
#: gm.meta key: (graph name, device) the scope ops of the graph were lowered for
LOWERED_META = "npugraph_ex_stream_events"
DEVICE_KEY = "_device"
CORE_KEYS = ("_op_aicore_num", "_op_vectorcore_num")


def _scope(node: torch.fx.Node) -> tuple[list[Any], list[Any]]:
    keys: Any = node.args[0] if node.args else node.kwargs.get("keys", ())
    values: Any = node.args[1] if len(node.args) > 1 else node.kwargs.get("values", ())
    return list(keys), list(values)


def _check_nesting(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(enter, exit) of every scope; raises PassError naming an unbalanced node."""
    open_: list[torch.fx.Node] = []
    pairs = []
    for node in graph.nodes:
        if is_scope_enter(node):
            open_.append(node)
        elif is_scope_exit(node):
            if not open_:
                raise PassError(
                    PASS_NAME,
                    f"npugraph_ex.scope_exit node {node.name!r} has no scope_enter before it: "
                    "every scope_exit closes the innermost open scope_enter of the graph",
                )
            pairs.append((open_.pop(), node))
    if open_:
        raise PassError(
            PASS_NAME,
            f"npugraph_ex.scope_enter node {open_[-1].name!r} is never closed: give it a "
            "scope_exit in the same compiled function (no graph break inside the scope)",
        )
    return pairs


def _is_epilogue(node: torch.fx.Node) -> bool:
    """AOT's ``copy_(input, new value)`` that writes a mutated input back at the graph's end."""
    return (
        node.op == "call_function"
        and node.target is torch.ops.aten.copy_.default
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].op in ("placeholder", "get_attr")
    )


def _join_point(graph: torch.fx.Graph) -> torch.fx.Node:
    """Where the default stream joins the side streams: before the mutated-input epilogue, so the
    write-back (and a write re-inplaced into the input on a side stream) is ordered by the join."""
    point: torch.fx.Node = next(n for n in reversed(graph.nodes) if n.op == "output")
    while point.prev.op != "root" and _is_epilogue(point.prev):
        point = point.prev
    return point


def _ops() -> Any:
    return torch.ops.npugraph_ex


def lower_stream_scopes(gm: torch.fx.GraphModule, device: torch.device, graph_name: str) -> bool:
    """Lower the scopes of ``gm`` (a graph of ``device``) in place. Returns whether it changed."""
    graph = gm.graph
    pairs = _check_nesting(graph)
    if not pairs and not any(is_record(n) or is_wait(n) for n in graph.nodes):
        return False
    dev = str(device)
    first_enter: dict[str, torch.fx.Node] = {}
    last_exit: dict[str, torch.fx.Node] = {}
    for enter, exit_ in pairs:
        keys, values = _scope(enter)
        if (USER_STREAM_LABEL in keys or any(k in keys for k in CORE_KEYS)) and (
            DEVICE_KEY not in keys
        ):
            enter.args, enter.kwargs = ([*keys, DEVICE_KEY], [*values, dev]), {}
        if USER_STREAM_LABEL in keys:
            label = str(values[keys.index(USER_STREAM_LABEL)])
            first_enter.setdefault(label, enter)
            last_exit[label] = exit_
    ops = _ops()
    if first_enter:
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        anchor = placeholders[-1] if placeholders else None
        if anchor is None:
            with graph.inserting_before(next(iter(graph.nodes))):
                entry = graph.call_function(ops.record.default, ())
        else:
            with graph.inserting_after(anchor):
                entry = graph.call_function(ops.record.default, ())
        for enter in first_enter.values():
            with graph.inserting_after(enter):
                graph.call_function(ops.wait.default, ([entry],))
        tokens = []
        for exit_ in last_exit.values():
            with graph.inserting_before(exit_):
                tokens.append(graph.call_function(ops.record.default, ()))
        with graph.inserting_before(_join_point(graph)):
            join = graph.call_function(ops.wait.default, (tokens,))
    for node in list(graph.nodes):
        if is_record(node):
            with graph.inserting_after(node):
                graph.call_function(ops.event_record.default, (f"{graph_name}_{node.name}", dev))
        elif is_wait(node):
            waited = node.args[0] if node.args else node.kwargs.get("nodes", ())
            for token in waited if isinstance(waited, (list, tuple)) else ():
                if not isinstance(token, torch.fx.Node) or token.op != "call_function":
                    continue  # a graph input: ready before the graph starts
                tag = f"{graph_name}_{token.name}"
                if not is_record(token):
                    # waiting for a tensor: its producer's stream records right after making it
                    with graph.inserting_after(token):
                        graph.call_function(ops.event_record.default, (tag, dev))
                with graph.inserting_before(node):
                    graph.call_function(ops.event_wait.default, (tag, dev))
    streams = StreamMap(graph)
    for node, stream_label in streams.label.items():
        node.meta["stream_label"] = stream_label
    gm.meta[LOWERED_META] = (graph_name, dev)
    if first_enter:
        crossing = _used_on_other_streams(graph, streams.label)
        if crossing:
            join.args = ([*tokens, *crossing],)
    gm.recompile()
    return True


def order_streams(gm: torch.fx.GraphModule, after: torch.fx.Node, before: torch.fx.Node) -> None:
    """``before``'s stream waits for ``after`` (a node on another stream): ``record()`` right
    after ``after`` and ``wait([it])`` right before ``before``, each with its graph event where
    the graph's scopes were lowered already."""
    graph, ops = gm.graph, _ops()
    with graph.inserting_after(after):
        token = graph.call_function(ops.record.default, ())
    with graph.inserting_before(before):
        wait = graph.call_function(ops.wait.default, ([token],))
    val = after.meta.get("val")
    if isinstance(val, torch.Tensor):
        token.meta["val"] = val.new_empty((1,), dtype=torch.int8)
    lowered = gm.meta.get(LOWERED_META)
    if lowered is None:
        return
    name, dev = lowered
    tag = f"{name}_{token.name}"
    with graph.inserting_after(token):
        record_event = graph.call_function(ops.event_record.default, (tag, dev))
    with graph.inserting_before(wait):
        wait_event = graph.call_function(ops.event_wait.default, (tag, dev))
    for node, at in ((token, after), (record_event, after), (wait, before), (wait_event, before)):
        node.meta["stream_label"] = at.meta.get("stream_label")


def _used_on_other_streams(
    graph: torch.fx.Graph, label: dict[torch.fx.Node, str | None]
) -> list[torch.fx.Node]:
    """Computed tensors that a node on another stream than their producer's uses."""
    crossing = []
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        if is_record(node):
            continue  # tokens: no memory anyone reads
        here = label.get(node)
        if any(label.get(user, here) != here for user in node.users if user.op != "output"):
            crossing.append(node)
    return crossing


def retag_graph_events(gm: torch.fx.GraphModule, old_name: str, new_name: str) -> bool:
    """Rename the events of a graph lowered as ``old_name`` to ``new_name``'s (a saved graph
    loaded in another process, where ``old_name`` may be another graph's). Returns whether any
    event was renamed."""
    ops = _ops()
    targets = (ops.event_record.default, ops.event_wait.default)
    old_prefix, changed = f"{old_name}_", False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in targets:
            tag = node.args[0]
            if isinstance(tag, str) and tag.startswith(old_prefix):
                node.args = (f"{new_name}_{tag[len(old_prefix):]}", *node.args[1:])
                changed = True
    if gm.meta.get(LOWERED_META, (None,))[0] == old_name:
        gm.meta[LOWERED_META] = (new_name, gm.meta[LOWERED_META][1])
    if changed:
        gm.recompile()
    return changed
