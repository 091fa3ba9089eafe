"""npugraph-passes is layered: its modules import one another without a cycle (imports inside
functions and modules named by string for a lazy import included), and the package imports
nothing of ours but npugraph_runtime (passes -> runtime -> torch)."""

from __future__ import annotations

import ast
from pathlib import Path

import npugraph_passes

PACKAGE = "npugraph_passes"
PACKAGE_DIR = Path(npugraph_passes.__file__).parent
MODULES = {f"{PACKAGE}.{p.stem}" if p.stem != "__init__" else PACKAGE: p for p in PACKAGE_DIR.glob("*.py")}
# our distributions above the passes: none of them may be imported from here
ABOVE = ("npugraph_cache", "npugraph_backend", "npugraph_ex")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(tree: ast.AST) -> set[str]:
    """Every module name ``tree`` imports at run time, at any depth (functions included), plus
    module names it holds as strings (``importlib.import_module`` tables); ``if TYPE_CHECKING:``
    blocks never run and are left out."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.add(node.module)
            # ``from pkg import mod`` imports the submodule
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES:
            names.add(node.value)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def _ours(name: str, source: str) -> set[str]:
    """The package's modules ``source`` (module ``name``) imports; the package itself is left out
    (every submodule loads it first; it imports the others only lazily, by name)."""
    return {m for m in _imported(ast.parse(source)) if m in MODULES and m not in (name, PACKAGE)}


def _edges() -> dict[str, set[str]]:
    return {name: _ours(name, path.read_text()) for name, path in MODULES.items()}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group: list[str] = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    groups.sort()
    return groups


def test_modules_import_one_another_without_a_cycle() -> None:
    edges = _edges()
    # the check sees imports inside functions and lazy imports by name
    assert "npugraph_passes.noop" in edges["npugraph_passes.manager"]
    assert "npugraph_passes.cat" in edges[PACKAGE]
    assert _cycles(edges) == []


def test_the_cycle_check_finds_a_function_level_cycle() -> None:
    # the shape fusion.py <-> npu_patterns.py had: one side imports the other inside a function
    fusion = "from npugraph_passes import _compat\nfrom npugraph_passes.npu_patterns import register\n"
    patterns = "from npugraph_passes import _compat\ndef f():\n    from npugraph_passes.fusion import fwd_only\n"
    edges = {"npugraph_passes.fusion": _ours("npugraph_passes.fusion", fusion),
             "npugraph_passes.npu_patterns": _ours("npugraph_passes.npu_patterns", patterns),
             "npugraph_passes._compat": set()}
    assert _cycles(edges) == [["npugraph_passes.fusion", "npugraph_passes.npu_patterns"]]


def test_passes_import_nothing_of_ours_above_them() -> None:
    upward = {
        name: sorted(m for m in _imported(ast.parse(path.read_text())) if m.split(".")[0] in ABOVE)
        for name, path in MODULES.items()
    }
    assert upward == {name: [] for name in MODULES}
