"""The npugraph_runtime names the benchmarks use, checked once, so that a runtime still being
built makes a benchmark report 'skipped: missing X' instead of failing halfway."""

from __future__ import annotations

from types import ModuleType

HAND_CAPTURE = ("Graph", "graph", "pool_bytes", "graph_pool_handle")
MANAGER = ("make_graphed_callable",)


class MissingRuntime(RuntimeError):
    pass


def runtime(*names: str) -> ModuleType:
    """npugraph_runtime, with `names` checked to exist (MissingRuntime naming what is missing)."""
    try:
        import npugraph_runtime as ngr
    except ImportError as exc:
        raise MissingRuntime(f"npugraph_runtime does not import: {exc}") from exc
    missing = [n for n in names if not hasattr(ngr, n)]
    if missing:
        raise MissingRuntime(f"npugraph_runtime has no {', '.join(missing)} yet")
    return ngr
