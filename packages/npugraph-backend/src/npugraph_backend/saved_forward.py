"""A saved graph's forward as the Python code FX generated for it, so that a load compiles that
code instead of rebuilding the FX graph node by node and generating the same code again
(``GraphPickler.loads`` plus ``recompile``: ~75 ms for a 12-layer Llama decode step).

Kept only for graphs whose forward needs nothing but its arguments and the globals FX gave it
(placeholders, calls and the output: no constant, submodule or ``self`` reference, no graph
event, whose tag a load renames), with every
global a module or a value that pickles by reference and comes back as the same object. The FX
graph is still saved, and unpickled on first use of anything but ``forward`` (dumps, debugging,
saving it again). The compiled code object is saved too (marshal), and used by an interpreter
with the same bytecode magic number; any other compiles the source. The code runs with the same trust as the rest of the entry: torch unpickles
that entry, which can run code too, so the compile cache authenticates the whole entry first."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import linecache
import marshal
import math
import pickle
import types
from collections.abc import Callable
from typing import Any

import torch

from npugraph_backend import _compat

_PLAIN_OPS = frozenset({"placeholder", "call_function", "output"})


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a is b


def _names_an_event(node: torch.fx.Node) -> bool:
    # event tags are named after the graph, which a load renames: such graphs load as FX
    return node.op == "call_function" and str(node.target).startswith("npugraph_ex.event_")


def saved_forward(gm: torch.fx.GraphModule, groups: tuple[str, ...]) -> dict[str, Any] | None:
    """What ``LoadedGraph`` needs to run ``gm.forward`` without the FX graph, or None when the
    forward needs more than its code and globals. ``groups``: the collectives' group names."""
    if any(node.op not in _PLAIN_OPS or _names_an_event(node) for node in gm.graph.nodes):
        return None
    code = gm.code
    forward = getattr(type(gm), "forward", None)
    if "self." in code or not isinstance(forward, types.FunctionType):
        return None
    names: dict[str, tuple[str, Any]] = {}
    for name, value in forward.__globals__.items():
        if name == "__builtins__":
            continue
        names[name] = ("module", value.__name__) if isinstance(value, types.ModuleType) else (
            "value", value)
    try:
        back = _resolved(pickle.loads(pickle.dumps(names)))
    except Exception:  # a global that does not pickle by reference: rebuild the graph on load
        return None
    if any(not _same(back[k], v) for k, v in forward.__globals__.items() if k != "__builtins__"):
        return None
    filename = f"<npugraph_ex saved graph {hashlib.sha256(code.encode()).hexdigest()[:16]}>"
    return {"code": code, "filename": filename, "globals": names, "groups": groups,
            "magic": importlib.util.MAGIC_NUMBER,
            "bytecode": marshal.dumps(compile(code, filename, "exec"))}


def _resolved(names: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    return {k: importlib.import_module(v) if kind == "module" else v
            for k, (kind, v) in names.items()}


class LoadedGraph:
    """A loaded graph: ``forward`` compiled from its saved code, ``collective_groups`` saved
    with it; anything else is the FX GraphModule, unpickled on first use."""

    def __init__(self, saved: dict[str, Any], graph_data: bytes) -> None:
        code: str = saved["code"]
        filename: str = saved["filename"]
        # tracebacks show the graph's lines, as FX's own generated code does
        linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
        if saved["magic"] == importlib.util.MAGIC_NUMBER:
            compiled = marshal.loads(saved["bytecode"])
        else:
            compiled = compile(code, filename, "exec")
        namespace = _resolved(saved["globals"])
        exec(compiled, namespace)  # trusted as the entry is: see the module docstring
        self.forward: Callable[..., Any] = types.MethodType(namespace["forward"], self)
        self.collective_groups: tuple[str, ...] = tuple(saved["groups"])
        self._graph_data = graph_data
        self._module: torch.fx.GraphModule | None = None

    def module(self) -> torch.fx.GraphModule:
        if self._module is None:
            self._module = _compat.graph_unpickle(self._graph_data, ())
        return self._module

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never the module's: a half-built instance would recurse
            raise AttributeError(name)
        return getattr(self.module(), name)
