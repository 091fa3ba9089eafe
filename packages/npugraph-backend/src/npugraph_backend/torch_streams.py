"""``torch.Stream`` / ``torch.Event`` (and ``torch.cuda.Stream`` / ``torch.cuda.Event``) in compiled
code, turned into the graph's own scope ops before AOT.

torch 2.13's dynamo traces ``with s:`` as a ``"stream"`` annotation of the enclosed nodes and the
Stream/Event methods as ``torch.ops.streams`` ops whose arguments are indices of the traced stream
and event objects. :func:`rewrite_torch_streams` rewrites both into what
``npugraph_runtime.stream`` / ``Event`` leave in a graph (``npugraph_ex.scope_enter`` with
``"_user_stream_label"``, ``record()`` tokens and ``wait([token])``), so one lowering
(``npugraph_passes.stream_scopes``) serves every stream API and every device:

* a stream that is the current stream of its device when traced is the graph's own stream; every
  other stream object becomes a side stream of this graph (labelled
  ``torch_stream_<graph>_<process tag>_<index>``: a graph saved by one process is lowered again
  by the process that loads it, where a label made of counters alone would name a stream that
  process gave the same label, for a graph of its own).
  On CUDA/NPU the user's stream itself runs the side-stream ops. On the CPU torch has one stream
  (every ``torch.Stream("cpu")`` is it, and ``torch.Event`` cannot be recorded eagerly): a CPU
  stream object that some ``with`` block of the graph runs ops on becomes a logical side stream of
  the emulated graph, with its race detection, as a side stream would be on a GPU; one that is only
  recorded on or waited by is the current stream it equals, i.e. the graph's own;
* ``Event.record(s)`` / ``Stream.record_event()`` -> a token recorded on ``s``; ``Event.wait(s)``
  -> ``s`` waits for the event's last record in the graph; ``a.wait_stream(b)`` -> a record on
  ``b`` that ``a`` waits for;
* a wait on work from before the graph (an accelerator event the graph never recorded, or
  ``a.wait_stream(b)`` before the graph ran anything on ``b``) cannot be captured: a device graph
  holds no dependency on work outside it. It becomes an *external wait* that the compiled
  function issues before every call, on the stream current then (which the whole replay follows:
  conservative, never racy). On the CPU, where every recorded event is already complete, there is
  nothing to wait for;
* ``Tensor.record_stream`` and dynamo's deallocation syncs are dropped: the captured graph keeps
  every tensor it uses alive until the graph itself is released;
* ``synchronize()`` of an event, stream or device is a host wait, which no device graph can hold:
  it is refused naming the node.

On a machine without an accelerator, torch 2.13's dynamo has no current stream, so
``Event.record()`` / ``wait()`` *without* a stream argument cannot be traced; importing this module
makes that a clear graph break (an error under ``fullgraph=True``) naming what to write instead."""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from npugraph_runtime.errors import NpugraphError
from npugraph_runtime.ops import register_user_stream
from npugraph_runtime.scope_keys import USER_STREAM_LABEL

from npugraph_backend import _compat

_GRAPHS = itertools.count(1)
_PROCESS_TAG = secrets.token_hex(4)  # see the module docstring: labels unique to the process
_DROPPED = frozenset({"record_stream"})
# node kinds that run ops (dynamo also annotates placeholders, which run nothing)
_COMPUTE = frozenset({"call_function", "call_method", "call_module"})
_HOST_SYNCS = {
    "synchronize_event": "torch.Event.synchronize()",
    "synchronize_stream": "torch.Stream.synchronize()",
    "synchronize_device": "torch.accelerator.synchronize() / torch.cuda.synchronize()",
}

NO_CPU_STREAM_HINT = (
    "torch.Event.record() / wait() without a stream cannot be traced on a machine with no "
    "accelerator (torch's dynamo knows no current CPU stream, and torch.Event cannot be recorded "
    "on the CPU). Pass the stream (event.record(s), event.wait(s)), or use npugraph_runtime.Stream"
    " / Event / stream(s) or npugraph_ex.scope.stream(tag) / record() / wait(tensors), which trace"
    " on every device."
)
_compat.install_cpu_stream_hint(NO_CPU_STREAM_HINT)


class TorchStreamError(NpugraphError):
    """A stream operation in compiled code that a device graph cannot hold."""


def _annotation(node: torch.fx.Node) -> int | None:
    custom = node.meta.get("custom")
    index = custom.get("stream") if isinstance(custom, dict) else None
    return index if isinstance(index, int) else None


def _is_current(stream: torch.Stream) -> bool:
    if stream.device.type == "cpu":
        return False  # decided by its use (see the module docstring)
    try:
        return bool(stream == torch.accelerator.current_stream(stream.device))
    except RuntimeError:
        return False


def _where(node: torch.fx.Node) -> str:
    trace = node.meta.get("stack_trace")
    last = str(trace).strip().splitlines()[-2:] if trace else []
    return f" at {' '.join(s.strip() for s in last)}" if last else ""


class _Rewriter:
    def __init__(self, gm: torch.fx.GraphModule, with_streams: set[int]) -> None:
        self.graph = gm.graph
        self.with_streams = with_streams  # stream indices some node is annotated with
        self.prefix = f"torch_stream_{next(_GRAPHS)}_{_PROCESS_TAG}"
        self.labels: dict[int, str | None] = {}
        self.tokens: dict[int, torch.fx.Node] = {}  # event index -> token of its last record
        self.open: str | None = None  # label of the annotation scope open before the next node
        self.active: set[str] = set()  # side-stream labels that ran or recorded something so far
        self.external: list[ExternalWait] = []
        self.ops: Any = torch.ops.npugraph_ex

    def label(self, index: int) -> str | None:
        if index not in self.labels:
            obj = _compat.external_object(index)
            cpu_current = (
                isinstance(obj, torch.Stream)
                and obj.device.type == "cpu"
                and index not in self.with_streams
            )
            if cpu_current or (isinstance(obj, torch.Stream) and _is_current(obj)):
                self.labels[index] = None
            else:
                label = self.labels[index] = f"{self.prefix}_{index}"
                if isinstance(obj, torch.Stream) and obj.device.type != "cpu":
                    register_user_stream(label, obj)  # the user's own device stream
        return self.labels[index]

    def _enter(self, before: torch.fx.Node, label: str) -> None:
        with self.graph.inserting_before(before):
            self.graph.call_function(self.ops.scope_enter.default, ([USER_STREAM_LABEL], [label]))

    def _exit(self, before: torch.fx.Node) -> None:
        with self.graph.inserting_before(before):
            self.graph.call_function(self.ops.scope_exit.default, ())

    def switch(self, before: torch.fx.Node, label: str | None) -> None:
        """Make ``label`` (None: the graph's stream) the stream of the nodes from ``before`` on."""
        if label == self.open:
            return
        if self.open is not None:
            self._exit(before)
        if label is not None:
            self._enter(before, label)
            self.active.add(label)
        self.open = label

    def on(self, before: torch.fx.Node, stream_index: Any, target: Any, args: Any) -> torch.fx.Node:
        """``target(*args)`` inserted before ``before``, on the stream of ``stream_index``."""
        self.switch(before, self.label(stream_index) if isinstance(stream_index, int) else None)
        with self.graph.inserting_before(before):
            return self.graph.call_function(target, args)

    def stream_op(self, node: torch.fx.Node, name: str) -> None:
        args = node.args
        if name == "record_event":
            self.tokens[int(args[0])] = self.on(node, args[1], self.ops.record.default, ())  # type: ignore[arg-type]
        elif name in ("wait_event", "sync_dealloc"):
            token = self.tokens.get(int(args[0]))  # type: ignore[arg-type]
            if token is not None:
                self.on(node, args[1], self.ops.wait.default, ([token],))
            elif name == "wait_event":
                self._external(_compat.external_object(int(args[0])))  # type: ignore[arg-type]
        elif name == "wait_stream":
            waited = args[1]
            label = self.label(waited) if isinstance(waited, int) else None
            if label is not None and label not in self.active:
                self._external(_compat.external_object(waited))  # type: ignore[arg-type]
            token = self.on(node, args[1], self.ops.record.default, ())
            self.on(node, args[0], self.ops.wait.default, ([token],))
        elif name in _HOST_SYNCS:
            raise TorchStreamError(
                f"{_HOST_SYNCS[name]} in a compiled function (node {node.name!r}{_where(node)}) "
                "waits on the host, which a device graph cannot capture: call it after the "
                "compiled function returns, or order the streams with Event.record / Event.wait"
            )
        elif name not in _DROPPED:
            raise TorchStreamError(
                f"torch.ops.streams.{name} (node {node.name!r}{_where(node)}) is not supported by "
                "npugraph_ex; use with-stream blocks, Event.record/wait and Stream.wait_stream"
            )
        self.graph.erase_node(node)

    def _external(self, obj: object) -> None:
        device = getattr(obj, "device", None)
        if isinstance(device, torch.device) and device.type != "cpu":
            self.external.append(ExternalWait(obj))

    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op in ("placeholder", "get_attr"):
                continue
            if node.op == "output":
                self.switch(node, None)
                continue
            name = _compat.stream_op_name(node)
            if name is not None:
                self.stream_op(node, name)
                continue
            if _compat.is_external_object_lookup(node):
                if not node.users:
                    self.graph.erase_node(node)
                continue
            index = _annotation(node)
            self.switch(node, self.label(index) if index is not None else None)


class ExternalWait:
    """One wait of a compiled graph on work from before it: an accelerator ``torch.Event``
    (``Event.wait``) or ``Stream`` (``wait_stream``) of the user's, waited on by the stream that is
    current when the compiled function is called."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __call__(self) -> None:
        obj: Any = self.obj
        if isinstance(obj, torch.Stream):
            torch.accelerator.current_stream(obj.device).wait_stream(obj)
        else:
            obj.wait()

    def __repr__(self) -> str:
        return f"ExternalWait({self.obj!r})"


def with_external_waits(
    compiled: Callable[..., Any], waits: list[ExternalWait]
) -> Callable[..., Any]:
    """``compiled`` issuing ``waits`` before each call (the backend's result for a graph that
    waits on work from before it), with the calling convention dynamo reads kept."""
    if not waits:
        return compiled

    def call(*args: Any) -> Any:
        for wait in waits:
            wait()
        return compiled(*args)

    call._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
    return call


EXTERNAL_WAITS = "npugraph_ex_external_waits"


def _refuse_stream_method_calls(nodes: list[torch.fx.Node]) -> None:
    """torch 2.11's dynamo traces ``Stream.wait_stream`` / ``wait_event`` / ``record_event`` /
    ``synchronize`` and the Event methods as ``call_method`` nodes on the traced objects (2.12.0
    and 2.13.0: ``torch.ops.streams`` ops), which AOT would run once at trace time and leave out
    of the graph: the replay would lose the ordering. Refused, naming the node."""
    for node in nodes:
        self_arg = node.args[0] if node.op == "call_method" and node.args else None
        if isinstance(self_arg, torch.fx.Node) and _compat.is_external_object_lookup(self_arg):
            raise TorchStreamError(
                f"{node.target}() on a torch.Stream / torch.Event (node {node.name!r}"
                f"{_where(node)}): torch {torch.__version__} traces it as a method call that a "
                "device graph cannot order; use torch >= 2.12, or npugraph_runtime.Stream / Event"
                " / stream(s) or npugraph_ex.scope.stream(tag) / record() / wait(tensors)"
            )


def rewrite_torch_streams(gm: torch.fx.GraphModule) -> bool:
    """Rewrite dynamo's stream annotations and ``torch.ops.streams`` ops of ``gm`` (a dynamo
    graph) into npugraph_ex scope ops, in place. Returns whether anything changed. Waits on work
    from before the graph are left in ``gm.meta[EXTERNAL_WAITS]`` for the backend to issue."""
    nodes = list(gm.graph.nodes)
    _refuse_stream_method_calls(nodes)
    with_streams = {i for n in nodes if n.op in _COMPUTE and (i := _annotation(n)) is not None}
    if not with_streams and not any(_compat.stream_op_name(n) for n in nodes):
        return False
    rewriter = _Rewriter(gm, with_streams)
    rewriter.run()
    if rewriter.external:
        gm.meta[EXTERNAL_WAITS] = rewriter.external
    for node in gm.graph.nodes:
        custom = node.meta.get("custom")
        if isinstance(custom, dict) and "stream" in custom:
            # AOT would otherwise apply torch's own stream handling to the annotation as well
            rest = {k: v for k, v in custom.items() if k != "stream"}
            if rest:
                node.meta["custom"] = rest
            else:
                del node.meta["custom"]
    gm.graph.lint()
    gm.recompile()
    return True
