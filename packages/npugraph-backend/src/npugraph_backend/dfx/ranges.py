"""``torch.profiler.record_function`` ranges for the phases of npugraph-ex, free when no profiler
is recording: ``phase(name)`` then returns one shared no-op context manager.

Range names (what a trace shows): ``npugraph_ex::compile``, ``npugraph_ex::passes``,
``npugraph_ex::capture``, ``npugraph_ex::copy_inputs``, ``npugraph_ex::replay``,
``npugraph_ex::data_dump``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, ParamSpec, TypeVar

import torch.profiler

from npugraph_backend import _compat

COMPILE = "npugraph_ex::compile"
PASSES = "npugraph_ex::passes"
CAPTURE = "npugraph_ex::capture"
COPY_INPUTS = "npugraph_ex::copy_inputs"
REPLAY = "npugraph_ex::replay"
DATA_DUMP = "npugraph_ex::data_dump"

#: Returned by ``phase`` when no profiler records; stateless, so one instance serves every caller.
NO_RANGE: AbstractContextManager[None] = contextlib.nullcontext()

_profiler_enabled = _compat.profiler_enabled


def phase(name: str) -> AbstractContextManager[Any]:
    """A profiler range called ``name`` while a profiler records, else ``NO_RANGE``."""
    if _profiler_enabled():
        return torch.profiler.record_function(name)
    return NO_RANGE


P = ParamSpec("P")
R = TypeVar("R")


def ranged(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: runs the function inside ``phase(name)``."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        def inner(*args: P.args, **kwargs: P.kwargs) -> R:
            if _profiler_enabled():
                with torch.profiler.record_function(name):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)

        inner.__name__ = getattr(fn, "__name__", "ranged")
        inner.__qualname__ = getattr(fn, "__qualname__", "ranged")
        inner.__doc__ = fn.__doc__
        inner.__wrapped__ = fn  # type: ignore[attr-defined]
        return inner

    return wrap
