"""The serving path's direct dispatch: after an entry's guards pass, call the backend's compiled
graph with a flat-argument plan instead of running dynamo's transformed bytecode, which fetches
every parameter through the module's attribute dicts on each call (~7 µs for 100 parameters).

A plan is made from one probed call (``_compat.probe_call``): each graph input is either one of
the call's own tensors (taken from the call) or a parameter or buffer of the module (held by the
plan). It is used only while no parameter, buffer or submodule has been assigned anywhere since
(``registrations``: torch's global registration hooks count every ``setattr`` of one, a
``register_*`` call, ``load_state_dict(assign=True)``); after one, the next call runs the bytecode
again and makes a new plan. A ``.data`` swap keeps the object and is the compiler's to see (the
npugraph_ex capture manager checks every parameter's address on each call)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Direct", "plan", "registrations"]

Direct = Callable[[tuple[Any, ...]], Any]

_count = [0]
_installed = False


def _bump(*_: object) -> None:
    _count[0] += 1


def registrations() -> int:
    """How many parameters, buffers and submodules were assigned to any module since the hooks
    were installed (on the first plan)."""
    return _count[0]


def _install() -> bool:
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
    not fit a plan: a graph input that is neither exactly one of ``args``, a tensor of
    ``module``, nor a dynamic size the bytecode reads from one of ``args`` (a global, an alias of
    both), or a result that is not the graph's output, one of its items, or a tuple of them."""
    if probe is None or not _install():
        return None
    graph, flat, out, sizes = probe
    own = {id(t) for _, t in itertools.chain(module.named_parameters(remove_duplicate=False),
                                             module.named_buffers(remove_duplicate=False))}
    template = list(flat)
    taken: list[tuple[int, int]] = []  # (graph input, call argument)
    sized: list[tuple[int, int, int]] = []  # (graph input, call argument, dim): a dynamic size
    reads = iter(sizes)
    for j, x in enumerate(flat):
        if type(x) is int:
            # the bytecode's next call_size(argument, dim); positions count the module first
            at, dim = next(reads, (0, 0))
            arg = args[at - 1] if 0 < at <= len(args) else None
            if not isinstance(arg, torch.Tensor) or not -arg.dim() <= dim < arg.dim() or (
                    arg.size(dim) != x):
                return None
            sized.append((j, at - 1, dim))
            continue
        if not isinstance(x, torch.Tensor):
            return None
        hits = [i for i, a in enumerate(args) if a is x]
        if len(hits) > 1 or (hits and id(x) in own) or (not hits and id(x) not in own):
            return None
        if hits:
            taken.append((j, hits[0]))
    pick = _output_picker(out, result)
    if pick is None or next(reads, None) is not None:
        return None
    n = len(args)
    leading = not sized and [j for j, _ in taken] == list(range(n)) and [
        i for _, i in taken] == list(range(n))
    rest = tuple(template[n:])

    if leading:  # the call's tensors come first (dynamo orders the frame's locals first)
        def direct(call: tuple[Any, ...]) -> Any:
            return pick(graph(*call, *rest))
    else:
        def direct(call: tuple[Any, ...]) -> Any:
            inputs = template.copy()
            for j, i in taken:
                inputs[j] = call[i]
            for j, i, d in sized:
                inputs[j] = call[i].size(d)
            return pick(graph(*inputs))

    return direct


def _output_picker(out: Any, result: Any) -> Callable[[Any], Any] | None:
    if result is out:
        return _same
    if type(out) not in (list, tuple):
        return None
    for k, o in enumerate(out):
        if result is o:
            return lambda got: got[k]
    if type(result) is tuple and result:
        where = [next((k for k, o in enumerate(out) if r is o), None) for r in result]
        if None not in where:
            return lambda got: tuple(got[k] for k in where)  # type: ignore[index]
    return None


def _same(got: Any) -> Any:
    return got
