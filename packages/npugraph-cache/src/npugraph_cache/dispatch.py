"""The serving path's direct dispatch: after an entry's guards pass, call the backend's compiled
graph with a flat-argument plan instead of running dynamo's transformed bytecode, which fetches
every parameter through the module's attribute dicts on each call (~7 µs for 100 parameters).

A plan is made from one probed call (``_compat.probe_call``), which says where the bytecode takes
each graph input: from the call's arguments (a tensor, an attribute or item of one such as a KV
cache object's tensors, or a dynamic size; fetched again on every call) or from the module's
parameter, buffer and submodule dicts (held by the plan). It is used only while no parameter, buffer or submodule has been assigned anywhere since
(``registrations``: torch's global registration hooks count every ``setattr`` of one, a
``register_*`` call, ``load_state_dict(assign=True)``); after one, the next call runs the bytecode
again and makes a new plan. A ``.data`` swap keeps the object and is the compiler's to see (the
npugraph_ex capture manager checks every parameter's address on each call)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from npugraph_cache import _compat

__all__ = ["Direct", "count_registrations", "plan", "registrations"]

Direct = Callable[[tuple[Any, ...]], Any]

_count = [0]
_installed = False


def _bump(*_: object) -> None:
    # Code that dynamo traces may build modules (ModuleList slicing, as transformers' models
    # do): traced, this count would be a side effect and a guard, recompiling every call.
    # Inside a compiled region nothing is assigned at run time, so it counts nothing there. Only
    # this thread's compile: an assignment in another thread meanwhile is counted (it was not,
    # and that thread's direct plan kept the old parameter for good)
    if _compat.traced_here():
        return
    _count[0] += 1


def registrations() -> int:
    """How many parameters, buffers and submodules were assigned to any module since the hooks
    were installed (on the first plan)."""
    return _count[0]


def count_registrations() -> bool:
    """Install the hooks ``registrations`` counts with (once); False where torch lacks them."""
    global _installed
    if not _installed:
        from torch.nn.modules import module as nn_module

        hooks = ("register_module_parameter_registration_hook",
                 "register_module_buffer_registration_hook",
                 "register_module_module_registration_hook")
        if not all(hasattr(nn_module, h) for h in hooks):
            return False
        for h in hooks:
            getattr(nn_module, h)(_bump)
        _installed = True
    return True


def plan(module: torch.nn.Module, args: tuple[Any, ...], probe: Any, result: Any) -> Direct | None:
    """``args -> result`` for later calls of the probed entry, or None when the probed call does
    not fit a plan: a graph input read from the module other than through its parameter, buffer
    and submodule dicts, one that the probe did not find where its path says, or a result that
    is not the graph's output, one of its items, or a tuple of them."""
    if probe is None or not count_registrations():
        return None
    graph, flat, out, paths = probe
    template = list(flat)
    fetched: list[tuple[int, Callable[[tuple[Any, ...]], Any]]] = []  # (graph input, getter)
    for j, (x, path) in enumerate(zip(flat, paths, strict=True)):
        at, steps = path[0], path[1:]
        if at == 0:  # the module's own tensors: held, re-planned after any assignment
            if not isinstance(x, torch.Tensor) or not all(
                    s in _MODULE_STEPS or (s[0] == "i" and type(s[1]) is str) for s in steps):
                return None
            continue
        get = _getter(at - 1, steps)
        if get is None:
            return None
        try:
            again = get(args)
        except Exception:
            return None
        if not (again is x or (type(x) is int and type(again) is int and again == x)):
            return None
        fetched.append((j, get))
    pick = _output_picker(out, result)
    if pick is None:
        return None
    inner = _unwrapped(graph, out)
    if inner is not None:
        call_graph, expected = inner

        def graph(*flat: Any) -> list[Any]:  # AOT's list convention and output check
            outs = call_graph(*flat)
            if type(outs) is not list:
                outs = list(outs) if isinstance(outs, tuple) else [outs]
            if len(outs) != expected:
                raise AssertionError(f"expected {expected} outputs, got {len(outs)}")
            return outs

    n = len(args)
    if [j for j, _ in fetched] == list(range(n)) and all(
            paths[j] == (j + 1,) for j in range(n)):
        rest = tuple(template[n:])
        if inner is not None:
            call_graph, expected = inner
            bound = _bound(call_graph, rest)

            def leading_unwrapped(call: tuple[Any, ...]) -> Any:  # graph() inlined: one frame less
                outs = bound(call)
                if type(outs) is not list:
                    outs = list(outs) if isinstance(outs, tuple) else [outs]
                if len(outs) != expected:
                    raise AssertionError(f"expected {expected} outputs, got {len(outs)}")
                return pick(outs)

            return leading_unwrapped

        def leading(call: tuple[Any, ...]) -> Any:  # the call's own tensors first, as dynamo orders
            return pick(graph(*call, *rest))

        return leading

    def direct(call: tuple[Any, ...]) -> Any:
        inputs = template.copy()
        for j, get in fetched:
            inputs[j] = get(call)
        return pick(graph(*inputs))

    return direct


_MODULE_STEPS = frozenset({("a", "_modules"), ("a", "_parameters"), ("a", "_buffers")})


def _getter(i: int, steps: tuple[Any, ...]) -> Callable[[tuple[Any, ...]], Any] | None:
    """The value at ``args[i]`` followed by ``steps`` (attributes, subscripts, a size)."""
    if not steps:
        return operator.itemgetter(i)
    if steps[-1][0] == "size":
        dim, inner = steps[-1][1], _getter(i, steps[:-1])
        if inner is None:
            return None
        return lambda call: inner(call).size(dim)  # type: ignore[misc]
    chain: list[Callable[[Any], Any]] = []
    for kind, name in steps:
        if kind == "a" and type(name) is str:
            chain.append(operator.attrgetter(name))
        elif kind == "i":
            chain.append(operator.itemgetter(name))
        else:
            return None

    def get(call: tuple[Any, ...]) -> Any:
        value = call[i]
        for step in chain:
            value = step(value)
        return value

    return get


def _unwrapped(graph: Any, out: Any) -> tuple[Callable[..., Any], int] | None:
    """Where AOTAutograd's wrappers around the backend's callable do nothing for this graph
    (``_compat.trivial_aot_call``; ~5 µs a call of frames, a profiler check and grad-mode tests),
    that callable taking the graph inputs as positional arguments, and how many outputs AOT
    checks it returns. None otherwise. A boxed callable that offers ``positional_call()`` (the
    npugraph_ex backend's does) gives the call it unboxes to, saving its own frames too."""
    boxed = _compat.trivial_aot_call(graph)
    if boxed is None or type(out) is not list:
        return None
    # its own group: the cache counters are what README examples and workers print
    _compat.dynamo_counters()["npugraph_ex_serving"]["boxed_plans"] += 1
    positional = getattr(boxed, "positional_call", None)
    call = positional() if callable(positional) else None
    if call is None:
        return (lambda *flat: boxed(list(flat))), len(out)
    return call, len(out)


def _bound(call_graph: Callable[..., Any], rest: tuple[Any, ...]) -> Callable[[tuple[Any, ...]], Any]:
    """``call -> call_graph(*call, *rest)``; where the graph is the npugraph_ex capture manager,
    its ``bind(rest)``: the held tensors are neither passed nor picked out again on each call."""
    bind = getattr(call_graph, "bind", None)
    bound = bind(rest) if callable(bind) else None
    if bound is not None:
        _compat.dynamo_counters()["npugraph_ex_serving"]["bound_plans"] += 1
        return bound  # type: ignore[no-any-return]
    return lambda call: call_graph(*call, *rest)


def _output_picker(out: Any, result: Any) -> Callable[[Any], Any] | None:
    if result is out:
        return _same
    if type(out) not in (list, tuple):
        return None
    for k, o in enumerate(out):
        if result is o:
            return operator.itemgetter(k)
    if type(result) is tuple and result:
        where = [next((k for k, o in enumerate(out) if r is o), None) for r in result]
        if None not in where:
            return lambda got: tuple(got[k] for k in where)  # type: ignore[index]
    return None


def _same(got: Any) -> Any:
    return got
