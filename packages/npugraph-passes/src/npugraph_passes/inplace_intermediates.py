"""Re-inplacing intermediates: ``y = op(x, ...)`` becomes ``op_(x, ...)`` when ``x`` is an
intermediate that nothing reads afterwards (see :mod:`npugraph_passes.reinplace`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from npugraph_passes import _compat
from npugraph_passes.collectives import is_ordering_point
from npugraph_passes.inplace_analysis import SCATTER_VIEWS, Analysis
from npugraph_passes.inplace_rewrite import (
    fits_in_place,
    others_alias,
    rewrite_in_place,
    streams_ok,
)

__all__ = ["inplace_pass"]


def _intermediate_candidate(node: torch.fx.Node, an: Analysis) -> torch.fx.Node | None:
    if node.op != "call_function" or not isinstance(node.target, _compat.OpOverload):
        return None
    if is_ordering_point(node) or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    if node.target not in SCATTER_VIEWS and _compat.inplace_overload(node.target) is None:
        return None
    dst = node.args[0]
    return dst if dst.op == "call_function" else None


def inplace_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
    """Re-inplaces functional ops on intermediates nobody reads afterwards. Needs
    ``node.meta["val"]``; nodes without it are left alone."""
    an = Analysis(gm.graph)
    for node in list(gm.graph.nodes):
        if node in an.erased:
            continue
        dst = _intermediate_candidate(node, an)
        if dst is None:
            continue
        key = an.storage.get(dst)
        if key is None or key in an.input_storages:
            continue
        if not fits_in_place(node, dst) or others_alias(node, dst, an):
            continue
        if an.reads_after(node, dst, ignore=set()):
            continue
        if not streams_ok(node, dst, an) or an.collective_memory(dst):
            continue
        rewrite_in_place(node, dst, an)
