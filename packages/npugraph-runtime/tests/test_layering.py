"""devices/ is the runtime's bottom layer: each of its modules, imported alone in a fresh
interpreter, loads no runtime module but devices/ and the leaves below it (see the docstring of
``npugraph_runtime.devices``)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import npugraph_runtime.devices

# what devices/ may import of the runtime besides itself: leaves that import nothing of ours but
# one another
BELOW_DEVICES = ("npugraph_runtime._compat", "npugraph_runtime.errors", "npugraph_runtime.schema",
                 "npugraph_runtime.spans")

DEVICES_DIR = Path(npugraph_runtime.devices.__file__).parent
PACKAGE_DIR = DEVICES_DIR.parent

# The package's __init__ imports the whole runtime, so it is replaced by an empty package of the
# same path: what a module loads is then what the module itself imports. Each module is imported
# after every runtime module of the previous one was dropped from sys.modules.
_SCRIPT = """
import importlib, json, sys, types
import torch
package = types.ModuleType("npugraph_runtime")
package.__path__ = [sys.argv[1]]
sys.modules["npugraph_runtime"] = package
loaded = {}
for name in sys.argv[2:]:
    for key in [k for k in sys.modules if k.startswith("npugraph_runtime.")]:
        del sys.modules[key]
    importlib.import_module(name)
    loaded[name] = sorted(k for k in sys.modules if k.startswith("npugraph_runtime."))
print(json.dumps(loaded))
"""


def _modules_of_devices() -> list[str]:
    names = ["npugraph_runtime.devices"]
    names += sorted(
        f"npugraph_runtime.devices.{p.stem}" for p in DEVICES_DIR.glob("*.py") if p.stem != "__init__"
    )
    return names


def _loaded_by(names: list[str]) -> dict[str, list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(PACKAGE_DIR), *names],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    loaded: dict[str, list[str]] = json.loads(done.stdout.strip().splitlines()[-1])
    return loaded


def _above_devices(modules: list[str]) -> list[str]:
    return [
        m
        for m in modules
        if m not in BELOW_DEVICES
        and m != "npugraph_runtime.devices"
        and not m.startswith("npugraph_runtime.devices.")
    ]


def test_every_module_of_devices_imports_nothing_above_it() -> None:
    names = _modules_of_devices()
    # the CPU pool and the core-unit probes live in devices/ now, next to the backends
    assert {"npugraph_runtime.devices.cpu_pool", "npugraph_runtime.devices.core_units"} <= set(names)
    loaded = _loaded_by([*names, "npugraph_runtime.graphs"])
    upward = {name: _above_devices(loaded[name]) for name in names}
    assert upward == {name: [] for name in names}
    # every module really was imported, and the check sees a module above devices/: graphs
    # loads streams
    for name in names:
        assert name in loaded[name]
    assert "npugraph_runtime.streams" in _above_devices(loaded["npugraph_runtime.graphs"])


def test_the_leaves_below_devices_import_only_one_another() -> None:
    loaded = _loaded_by(list(BELOW_DEVICES))
    for name in BELOW_DEVICES:
        assert set(loaded[name]) <= set(BELOW_DEVICES), (name, loaded[name])


# --- every import statement, function-level ones included -----------------------------------
# An import inside a function runs only when the function does, so importing a module alone does
# not show it; the source does. The package's __init__ (the facade that imports everything) is
# not a layer: an edge to ``npugraph_runtime`` itself is not counted.


def _module_names() -> dict[str, Path]:
    names: dict[str, Path] = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        names[name] = path
    return names


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The runtime modules ``name``'s source imports, at any depth of its code."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target not in ("npugraph_runtime", name):
                found.add(target)
    return found


def _import_graph() -> dict[str, set[str]]:
    modules = _module_names()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_the_runtime_function_level_imports_included() -> None:
    graph = _import_graph()
    assert "npugraph_runtime.devices.cpu" in graph["npugraph_runtime.devices"]  # a function-level one
    assert _cycles(graph) == []


def test_the_cycle_check_sees_a_function_level_import() -> None:
    graph = _import_graph()
    # what the CPU replay once did to reach the scope ops: devices -> ops -> streams -> devices
    graph["npugraph_runtime.devices.cpu_replay"].add("npugraph_runtime.ops")
    assert any("npugraph_runtime.ops" in c for c in _cycles(graph))


def test_no_module_of_devices_imports_above_it_anywhere_in_its_source() -> None:
    graph = _import_graph()
    upward = {name: sorted(t for t in targets if t not in BELOW_DEVICES
                           and not t.startswith("npugraph_runtime.devices"))
              for name, targets in graph.items() if name.startswith("npugraph_runtime.devices")}
    assert upward == {name: [] for name in upward}
