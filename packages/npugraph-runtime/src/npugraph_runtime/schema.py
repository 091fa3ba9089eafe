"""What an operator's schema says, read for every op of every capture by the CPU recorder and by
the generic input checks (``inputs``). A leaf below devices/: it imports only ``_compat``."""

from __future__ import annotations

from functools import cache
from typing import Any

from npugraph_runtime import _compat


def overload_name(func: Any) -> str:
    """``"aten::add.Tensor"``: the op's name and overload (the name alone for the default)."""
    schema = _compat.op_schema(func)
    return f"{schema.name}.{schema.overload_name}" if schema.overload_name else str(schema.name)


@cache
def write_positions(func: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Positional indices and keyword names of the arguments the op writes (``Tensor(a!)``).
    Cached: it is asked for every op of every capture."""
    positions: list[int] = []
    names: list[str] = []
    for i, arg in enumerate(_compat.op_schema(func).arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            if arg.kwarg_only:
                names.append(arg.name)
            else:
                positions.append(i)
    return tuple(positions), tuple(names)
