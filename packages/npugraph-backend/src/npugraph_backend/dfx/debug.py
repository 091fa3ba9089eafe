"""TORCH_COMPILE_DEBUG=1 dumps: what each compile saw, what every pass did, the final graph and
how it is run, and one JSON per captured device graph.

Layout (``<run>`` is dynamo's ``torch_compile_debug/run_<time>-pid_<pid>``, with ``-rank_<r>``
appended when torch.distributed is initialised)::

    <run>/npugraph_ex/
      debug.log                                   the npugraph_ex logger at DEBUG
      model__<N>/                                 one per compiled graph, N = 0, 1, ...
        dynamo_out_graph.txt                      the graph dynamo handed over (not via compile_fx)
        loaded.txt                                instead, for a graph loaded from a saved compile
        forward/000_aot_forward_graph.txt         the AOT inference graph, before any pass
        forward/NNN_aot_forward_graph_after_<pass>.txt   after each pass that ran, NNN increasing
        forward/output_code.py                    the final graph and how it is run
        graph_<NNN>_<name>.json                   one per capture (key, inputs, outputs, pool, ops)

When the variable is not "1", ``DebugSession.begin`` returns None after one environment lookup
and nothing else in this module runs."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import os
import pprint
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx

from npugraph_backend import _compat
from npugraph_backend.dfx.log import attach_debug_file, logger

_ENV = "TORCH_COMPILE_DEBUG"

_lock = threading.Lock()
_root: str | None = None
_models = itertools.count()


def enabled() -> bool:
    """True when TORCH_COMPILE_DEBUG=1 (read every time, as torch does)."""
    return os.environ.get(_ENV, "0") == "1"


def _rank_suffix() -> str:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return f"-rank_{dist.get_rank()}"
    return ""


def debug_root() -> str:
    """``<run>/npugraph_ex``, created on first use (one per process) with debug.log attached."""
    global _root
    with _lock:
        if _root is None:
            root = os.path.join(_compat.dynamo_debug_dir() + _rank_suffix(), "npugraph_ex")
            os.makedirs(root, exist_ok=True)
            _root = root
    attach_debug_file(os.path.join(_root, "debug.log"))
    return _root


def graph_text(gm: torch.fx.GraphModule) -> str:
    """Readable code of ``gm`` regenerated from its graph (so an un-recompiled graph is shown as
    it is), with shapes, strides and devices."""
    return gm.print_readable(print_output=False, include_stride=True, include_device=True)


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _jsonable(value: object) -> object:
    """Plain JSON values: tuples become lists, devices/dtypes/enums/pools their str()."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    enum_value = getattr(value, "value", None)
    if isinstance(enum_value, str):
        return enum_value
    return str(value)


_COPY_NOTE = {
    "static": "never copied (parameter, buffer or static address)",
    "mutated": "never copied; updated in place by the graph; a new address recaptures",
    "symbolic": "an int: selects the captured graph (part of the key)",
    "constant": "passed through; must not change",
}


def spec_summary(
    gm: torch.fx.GraphModule,
    spec: Any,
    policy: Any,
    output_spec: Any = None,
) -> dict[str, object]:
    """What ``output_code`` and the capture JSONs say about how ``gm`` is run, built from the
    runtime's InputSpec / CapturePolicy / OutputSpec (read by attribute)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kinds = list(getattr(spec, "kinds", ()))
    clone_input = bool(getattr(policy, "clone_input", True))
    inputs: list[dict[str, object]] = []
    for i, kind in enumerate(kinds):
        name = placeholders[i].name if i < len(placeholders) else f"input_{i}"
        kind_name = str(getattr(kind, "value", kind))
        if kind_name == "user":
            note = (
                "copied into the capture's buffer when its address differs from the buffer"
                if clone_input
                else "captured in place; a tensor at a new address overwrites the captured one"
            )
        else:
            note = _COPY_NOTE.get(kind_name, "")
        val = placeholders[i].meta.get("val") if i < len(placeholders) else None
        entry: dict[str, object] = {"index": i, "name": name, "kind": kind_name, "per_call": note}
        if isinstance(val, torch.Tensor):
            entry.update(shape=[str(s) for s in val.shape], dtype=str(val.dtype), device=str(val.device))
        keyed = spec.dims_keyed(i) if hasattr(spec, "dims_keyed") else None
        if kind_name in ("user", "mutated"):
            entry["keyed_dims"] = "all" if keyed is None else list(keyed)
        inputs.append(entry)
    aliases = list(getattr(output_spec, "aliases_input", ()) or ())
    outputs = [{"index": j, "aliases_input": a} for j, a in enumerate(aliases)]
    if dataclasses.is_dataclass(policy) and not isinstance(policy, type):
        policy_dict = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    else:
        policy_dict = {"policy": repr(policy)}
    return {
        "inputs": inputs,
        "copied_per_call": [e["name"] for e in inputs if e["kind"] == "user" and clone_input],
        "outputs": outputs,
        "policy": _jsonable(policy_dict),
    }


class DebugSession:
    """The debug dumps of one compiled graph (``model__<N>``). Create with ``begin``."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.phase_dir = os.path.join(model_dir, "forward")
        os.makedirs(self.phase_dir, exist_ok=True)
        self._step = 0
        self._captures = 0
        self.files: list[str] = []

    @classmethod
    def begin(cls, dynamo_gm: torch.fx.GraphModule | None = None) -> DebugSession | None:
        """A new session when TORCH_COMPILE_DEBUG=1, else None. ``dynamo_gm`` (the graph dynamo
        gave the backend) is written to dynamo_out_graph.txt; compile_fx passes None."""
        if not enabled():
            return None
        model_dir = os.path.join(debug_root(), f"model__{next(_models)}")
        session = cls(model_dir)
        if dynamo_gm is not None:
            session._dump("dynamo_out_graph.txt", graph_text(dynamo_gm), in_phase=False)
        logger.debug("debug dumps of this graph go to %s", model_dir)
        return session

    def _dump(self, name: str, text: str, *, in_phase: bool = True) -> str:
        path = os.path.join(self.phase_dir if in_phase else self.model_dir, name)
        _write(path, text)
        self.files.append(path)
        return path

    def forward_graph(self, gm: torch.fx.GraphModule) -> None:
        """The AOT inference graph before any pass: ``forward/000_aot_forward_graph.txt``."""
        self._step = 0
        self._dump("000_aot_forward_graph.txt", graph_text(gm))

    @property
    def pass_observer(self) -> Callable[[str, torch.fx.GraphModule, Any], None]:
        """For ``PassManager.run(..., observer=)``: writes the graph after each pass."""
        return self._after_pass

    def _after_pass(self, pass_name: str, gm: torch.fx.GraphModule, record: Any) -> None:
        # The compiler logs each record (time, changed, node counts); this only dumps the graph.
        self._step += 1
        self._dump(f"{self._step:03d}_aot_forward_graph_after_{pass_name}.txt", graph_text(gm))

    def loaded(self, name: str) -> str:
        """``loaded.txt`` of a graph loaded from a saved compile: why its folder holds no
        dynamo or per-pass dumps."""
        return self._dump("loaded.txt", (
            f"{name} was loaded from a saved compile (npugraph_ex.inference.cache_compile's disk "
            "cache, or torch's AOTAutograd cache): dynamo, AOT and the passes did not run in "
            "this process, so there is no dynamo_out_graph.txt and no per-pass graph here.\n"
            "forward/output_code.py is the loaded graph; graph_*.json are this process's "
            "captures of it. `npugraph-ex cache show ENTRY` prints the graphs the compiling "
            "process saw (`npugraph-ex cache ls CACHE_DIR` lists the entries).\n"), in_phase=False)

    def output_code(self, gm: torch.fx.GraphModule, summary: Mapping[str, object]) -> str:
        """``forward/output_code.py``: the final graph as a module class, plus how it is run
        (``summary`` from ``spec_summary``: input kinds, what is copied per call, the policy)."""
        lines = ["# npugraph_ex output code: the optimized graph and how it is run.", "#"]
        for entry in summary.get("inputs", []) or []:  # type: ignore[attr-defined]
            lines.append(f"#   input {entry['index']} {entry['name']} [{entry['kind']}]: {entry['per_call']}")
        copied = summary.get("copied_per_call")
        lines.append(f"#   copied per call (when the address differs): {copied}")
        lines.append(f"#   capture policy: {summary.get('policy')}")
        lines += [
            "",
            "import torch",
            "from torch import device  # noqa: F401  (device literals in the graph code)",
            "",
            "",
            graph_text(gm).rstrip(),
            "",
            "",
            "RUN_SPEC = " + pprint.pformat(_jsonable(summary), width=100, sort_dicts=False),
            "",
            "",
            'if __name__ == "__main__":',
            "    import pprint",
            "",
            "    pprint.pprint(RUN_SPEC, sort_dicts=False)",
            "",
        ]
        return self._dump("output_code.py", "\n".join(lines))

    def captured_graph(self, info: Mapping[str, object]) -> str:
        """One JSON per captured graph in ``model__<N>/`` (what ``info`` holds, made plain)."""
        self._captures += 1
        name = str(info.get("graph", "graph"))
        fname = f"graph_{self._captures:03d}_{name}.json"
        payload = dict(_jsonable(info))  # type: ignore[call-overload]
        payload.setdefault("pid", os.getpid())
        payload.setdefault("time", datetime.datetime.now(datetime.UTC).isoformat())
        return self._dump(fname, json.dumps(payload, indent=2) + "\n", in_phase=False)

    def watch(self, graphed: Any, summary: Mapping[str, object]) -> Callable[..., Any]:
        """Wraps a ``GraphedCallable``: after each call, writes one JSON for each capture (or
        fallback) event the call added. Use the wrapper only when debugging."""
        seen = [len(getattr(graphed, "events", ()))]

        def call(*args: Any, **kwargs: Any) -> Any:
            out = graphed(*args, **kwargs)
            events = graphed.events
            if len(events) != seen[0]:
                for event in events[seen[0]:]:
                    self.captured_graph(capture_info(graphed, event, summary))
                seen[0] = len(events)
            return out

        call.__wrapped__ = graphed  # type: ignore[attr-defined]
        return call


def capture_info(graphed: Any, event: Any, summary: Mapping[str, object]) -> dict[str, object]:
    """What is known about the device graph that ``event`` (a CaptureEvent) captured."""
    key = getattr(event, "key", None)
    reason = getattr(event, "reason", None)
    info: dict[str, object] = {
        "graph": getattr(graphed, "name", "graph"),
        "key": _jsonable(key),
        "reason": reason,
        "inputs": summary.get("inputs"),
        "outputs": summary.get("outputs"),
        "policy": summary.get("policy"),
        "fell_back": bool(getattr(graphed, "fell_back", False)),
    }
    graphs = getattr(graphed, "graphs", {}) or {}
    graph = graphs.get(key) if isinstance(graphs, Mapping) else None
    if graph is None:
        info["captured"] = False
        return info
    info["captured"] = True
    info["device"] = str(getattr(graph, "device", ""))
    info.update(_pool_info(graph))
    recorded = getattr(graph, "recorded_ops", None)
    info["op_count"] = recorded() if callable(recorded) else None
    if str(getattr(graph, "device", "")).startswith("npu"):
        info["runtime_json"] = _runtime_dump(graph)
    return info


def _pool_info(graph: Any) -> dict[str, object]:
    try:
        pool = graph.pool()
    except Exception as exc:  # a graph without a pool yet: say so instead of failing the dump
        return {"pool": f"unavailable: {type(exc).__name__}: {exc}"}
    out: dict[str, object] = {"pool": {"device": str(pool.device), "ident": repr(pool.ident)}}
    try:
        import npugraph_runtime

        pool_bytes = getattr(npugraph_runtime, "pool_bytes", None)
        if pool_bytes is not None:
            out["pool_bytes"] = int(pool_bytes(pool))
    except Exception as exc:
        out["pool_bytes"] = f"unavailable: {type(exc).__name__}: {exc}"
    return out


def _runtime_dump(graph: Any) -> str:
    """The NPU runtime's own JSON of the graph (aclgraph's ``debug_dump``), written into the run
    directory; the reason when the graph cannot give one (it needs debug mode before capture)."""
    dump = getattr(graph, "debug_dump", None)
    if not callable(dump):
        return f"unavailable: {type(graph).__name__} has no debug_dump"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d%H%M%S%f")
    path = os.path.join(debug_root(), f"npu_graph_{id(graph)}_pid_{os.getpid()}_ts_{stamp}.json")
    try:
        dump(path)
    except Exception as exc:
        return f"unavailable: {type(exc).__name__}: {exc}"
    return path
