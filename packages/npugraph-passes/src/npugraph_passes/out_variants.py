"""out= variants of ATen ops: ``f.overload`` -> the overload of ``f`` that writes into ``out=``."""

from __future__ import annotations

import functools
from typing import Any

from npugraph_passes._compat import OpOverload, op_schema


def _signature(schema: Any, drop_out: bool) -> list[tuple[str, str]]:
    return [
        (a.name, str(a.type)) for a in schema.arguments
        if not (drop_out and a.alias_info is not None and a.alias_info.is_write and a.kwarg_only)
    ]


@functools.cache
def out_overload(op: object) -> Any:
    """The out= overload of ``op`` whose other arguments (names and types) are ``op``'s own, for
    an op returning one tensor; None when there is none (views, in-place ops, multi-output)."""
    if not isinstance(op, OpOverload):
        return None
    schema = op_schema(op)
    if schema.is_mutable or len(schema.returns) != 1 or str(schema.returns[0].type) != "Tensor":
        return None
    if schema.returns[0].alias_info is not None:  # a view of an input
        return None
    packet = op.overloadpacket
    want = _signature(schema, drop_out=False)
    for name in packet.overloads():
        cand = getattr(packet, name)
        cs = op_schema(cand)
        outs = [a for a in cs.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
        if len(outs) != 1 or outs[0].name != "out" or str(outs[0].type) != "Tensor":
            continue
        if _signature(cs, drop_out=True) == want:
            return cand
    return None
