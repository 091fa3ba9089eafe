"""A compiled graph belongs to the process groups it was compiled and captured with.

A traced collective names its group by a string (``"0"`` for the default group). Destroying the
default group and initialising a new one registers the new group under the same name, and dynamo
does not recompile: the graph would silently run its collectives on a group it never captured
with (on a device, with a communicator baked into the device graph that may be gone). Each call
of a graph with collectives checks that every group name still resolves to the same group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx
from npugraph_runtime.errors import NpugraphError

from npugraph_backend import _compat


class ProcessGroupChangedError(NpugraphError):
    """A compiled graph was called under another process group than it was captured with."""


def group_names(gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """The group names the graph's collectives use, in first-use order (saved with a graph
    loaded without its FX graph: ``saved_forward.LoadedGraph.collective_groups``)."""
    saved = getattr(gm, "collective_groups", None)
    if saved is not None:
        return tuple(saved)
    names: dict[str, None] = {}
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or getattr(target, "namespace", None) != "_c10d_functional":
            continue
        schema = _compat.op_schema(node)
        for i, arg in enumerate(schema.arguments if schema is not None else ()):
            if arg.name == "group_name":
                value = node.args[i] if i < len(node.args) else node.kwargs.get("group_name")
                if isinstance(value, str):
                    names[value] = None
    return tuple(names)


def guard(fn: Callable[..., Any], gm: torch.fx.GraphModule, graph: str) -> Callable[..., Any]:
    """``fn`` bound to the groups its first call (the capture) ran under, refusing to run once
    one of them is gone or replaced. Binding at the first call, not at build, lets a graph
    loaded from a cache bind to the groups of the process that loads it."""
    names = group_names(gm)
    if not names:
        return fn
    bound: list[tuple[str, Any]] = []

    def refuse(name: str, why: str) -> ProcessGroupChangedError:
        return ProcessGroupChangedError(
            f"{graph} was captured with process group {name!r}, which {why}: a device graph "
            "replays its collectives on the group it captured with. Compile again under the new "
            "group (torch._dynamo.reset() after changing process groups)"
        )

    def resolve(name: str) -> Any:
        try:
            return _compat.resolve_process_group(name)
        except (RuntimeError, ValueError):
            raise refuse(name, "does not exist now (destroyed, or not initialised)") from None

    def checked(*args: Any) -> Any:
        if not bound:
            bound.extend((name, resolve(name)) for name in names)
        for name, group in bound:
            if resolve(name) is not group:
                raise refuse(name, "was destroyed and another group now has its name")
        return fn(*args)

    return checked
