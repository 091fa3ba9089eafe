"""Tensor data dump (``dump_tensor_data=True``): the value of every tensor node of a graph, graph
inputs included, written at every call as
``<data_dump_dir>/worldsize<W>_global_rank<R>/<node name>_device_<d>_<count>.pt``.

* ``data_dump_stage="optimized"`` (``instrument``): the graph after the passes, captured and
  replayed as usual. After each tensor node the graph copies the node into a host buffer that
  was allocated at compile time and is held by the graph module (pinned memory for CUDA/NPU,
  so the device-to-host copy is an asynchronous copy that a device graph captures). The copies
  are part of the graph, so they are captured and replayed with it; ``after_each_call`` writes
  the buffers once the call (warm-up, capture, replay or eager fallback) has finished.
* ``data_dump_stage="original"`` (``original_runner``): the graph as AOT produced it, before any
  pass, run eagerly by an FX interpreter that saves each node's value as it is computed.

``W``/``R`` are torch.distributed's world size and rank when it is initialised, else 1/0.
``<count>`` counts the files written under one name in this process: the call number of the
graph when one graph owns the name. Multi-output nodes are saved through their getitem nodes.

The user must guarantee that data_dump_dir exists and can hold one file per node per call; the
optimized stage needs static shapes (compile with ``dynamic=False``), since its buffers are
allocated before the first call."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from npugraph_backend import _compat
from npugraph_backend.config import OptionError
from npugraph_backend.dfx.log import logger
from npugraph_backend.dfx.ranges import DATA_DUMP, phase

_META_KEY = "npugraph_ex_data_dump"
_BUFFER_PREFIX = "_npugraph_ex_dump_"

_count_lock = threading.Lock()
_counts: dict[str, int] = {}


def world() -> tuple[int, int]:
    """(world size, global rank) from torch.distributed when initialised, else (1, 0)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def dump_root(config: Any) -> str:
    """``<data_dump_dir>/worldsize<W>_global_rank<R>``, created; data_dump_dir must exist."""
    base = getattr(config, "data_dump_dir", "./")
    if not isinstance(base, str | os.PathLike) or not os.path.isdir(base):
        raise OptionError(
            f"option 'data_dump_dir': value {base!r} is not allowed; allowed: the path of an "
            f"existing directory (create it first; dump_tensor_data writes under it)"
        )
    size, rank = world()
    root = os.path.join(os.fspath(base), f"worldsize{size}_global_rank{rank}")
    os.makedirs(root, exist_ok=True)
    return root


def _device_index(device: torch.device) -> int:
    return 0 if device.index is None else int(device.index)


def dump_path(root: str, node_name: str, device: torch.device) -> str:
    """The next file for ``node_name`` under ``root``: ``<node>_device_<d>_<count>.pt``."""
    stem = os.path.join(root, f"{node_name}_device_{_device_index(device)}")
    with _count_lock:
        count = _counts.get(stem, 0)
        _counts[stem] = count + 1
    return f"{stem}_{count}.pt"


# --- stage "optimized" ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Slot:
    node: str
    attr: str  # the host buffer's attribute on the graph module
    device: torch.device  # where the node's value lives


class DataDumper:
    """Writes the host buffers of an instrumented graph module after a call."""

    def __init__(self, gm: torch.fx.GraphModule, root: str, slots: list[_Slot]) -> None:
        self.root = root
        self.slots = [(s.node, getattr(gm, s.attr), s.device) for s in slots]
        self.devices = sorted({s.device for s in slots if s.device.type != "cpu"}, key=str)

    def write(self) -> None:
        """Waits for the device copies, then writes one file per instrumented node."""
        with phase(DATA_DUMP):
            for device in self.devices:
                torch.get_device_module(device).synchronize(device)
            for node, buffer, device in self.slots:
                torch.save(buffer, dump_path(self.root, node, device))


def _static_shape(node: torch.fx.Node, val: torch.Tensor) -> tuple[int, ...]:
    shape: list[int] = []
    for s in val.shape:
        if not isinstance(s, int):
            raise OptionError(
                f"option 'data_dump_stage': value 'optimized' is not allowed for a graph with "
                f"symbolic shapes (node {node.name!r} has shape {tuple(val.shape)}); allowed: "
                f"'original', or compile with dynamic=False"
            )
        shape.append(s)
    return tuple(shape)


def _tensor_value(node: torch.fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _without_metadata(nodes: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """Nodes whose value is unknown (no ``node.meta['val']``); refused when that is every node."""
    missing = [n for n in nodes if "val" not in n.meta]
    if missing and len(missing) == len(nodes):
        raise ValueError(
            f"dump_tensor_data: the graph's nodes carry no node.meta['val'] (first: "
            f"{missing[0].name!r}), so their shapes are unknown; dump an AOT or make_fx graph"
        )
    return missing


def instrument(gm: torch.fx.GraphModule, config: Any) -> torch.fx.GraphModule:
    """Stage "optimized": after every tensor node of ``gm`` (placeholders included), insert
    ``aten.copy_(host_buffer, node, non_blocking=True)`` into a host buffer held by ``gm``.
    ``gm`` is changed in place and returned; wrap the compiled callable with
    ``after_each_call`` to write the buffers."""
    root = dump_root(config)
    graph = gm.graph
    nodes = [n for n in graph.nodes if n.op != "output"]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    # Copies of inputs go after the last placeholder, keeping placeholders first.
    input_anchor: torch.fx.Node | None = placeholders[-1] if placeholders else None
    slots: list[_Slot] = []
    skipped = [n.name for n in _without_metadata(nodes)]
    for node in nodes:
        val = _tensor_value(node)
        if val is None:
            continue
        if val.layout != torch.strided:
            skipped.append(node.name)
            continue
        shape = _static_shape(node, val)
        pinned = val.device.type != "cpu"
        with _compat.real_tensors():
            buffer = torch.empty(shape, dtype=val.dtype, device="cpu", pin_memory=pinned)
        attr = f"{_BUFFER_PREFIX}{len(slots)}"
        gm.register_buffer(attr, buffer, persistent=False)
        anchor = input_anchor if node.op == "placeholder" else node
        assert anchor is not None
        with graph.inserting_after(anchor):
            get = graph.get_attr(attr)
        with graph.inserting_after(get):
            copy = graph.call_function(torch.ops.aten.copy_.default, (get, node, True))
        if node.op == "placeholder":
            input_anchor = copy
        slots.append(_Slot(node.name, attr, val.device))
    if skipped:
        logger.warning("dump_tensor_data: not dumping %s (no metadata or not strided)", skipped)
    graph.lint()
    gm.recompile()
    # Plain data, so a pickled graph module keeps its dump plan.
    gm.meta[_META_KEY] = {"root": root, "slots": [(s.node, s.attr, str(s.device)) for s in slots]}
    logger.debug("dump_tensor_data: %d nodes of the optimized graph dumped to %s", len(slots), root)
    return gm


def dumper_of(gm: torch.fx.GraphModule) -> DataDumper | None:
    """The dumper ``instrument`` attached to ``gm``, if any."""
    plan = getattr(gm, "meta", {}).get(_META_KEY)
    if not isinstance(plan, dict):
        return None
    slots = [_Slot(node, attr, torch.device(device)) for node, attr, device in plan["slots"]]
    return DataDumper(gm, str(plan["root"]), slots)


def after_each_call(fn: Callable[..., Any], gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """``fn`` (the compiled callable of ``gm``) followed by writing ``gm``'s dump buffers; ``fn``
    itself when ``gm`` was not instrumented."""
    dumper = dumper_of(gm)
    if dumper is None:
        return fn
    write = dumper.write

    def call(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        write()
        return out

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


# --- stage "original" ----------------------------------------------------------------------------


def _copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A module with its own copy of the graph (passes rewrite ``gm.graph`` in place) sharing
    ``gm``'s parameters and constants."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


class _DumpingInterpreter(torch.fx.Interpreter):
    def __init__(self, module: torch.fx.GraphModule, root: str) -> None:
        super().__init__(module)
        self.root = root

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if isinstance(result, torch.Tensor) and n.op != "output":
            torch.save(_host_copy(result), dump_path(self.root, n.name, result.device))
        return result


def original_runner(gm: torch.fx.GraphModule, config: Any) -> Callable[..., Any]:
    """Stage "original": a callable that runs ``gm`` as it is now (call this before the passes)
    eagerly, saving every tensor node, and returns what ``gm`` returns. Never captures."""
    root = dump_root(config)
    module = _copy_graph_module(gm)
    logger.debug("dump_tensor_data: the original graph runs eagerly, dumped to %s", root)

    def run(*args: Any) -> Any:
        with phase(DATA_DUMP):
            return _DumpingInterpreter(module, root).run(*args)

    run.__wrapped__ = module  # type: ignore[attr-defined]
    return run
