"""Every private torch API the runtime touches, each with the torch versions it was checked on.
A torch upgrade is a change to this file only."""

from __future__ import annotations

from typing import Any


# --- ops.py: keep marker ops through FX dead-code elimination ----------------------------------
def mark_side_effectful(op: Any) -> None:
    """Checked on torch 2.13.0: ``torch.fx.node.has_side_effect`` (public, not backward-compatible
    tagged); older torch only had the private set ``torch.fx.node._side_effectful_functions``."""
    import torch.fx.node as fx_node

    register = getattr(fx_node, "has_side_effect", None)
    if register is not None:
        register(op)
    else:
        fx_node._side_effectful_functions.add(op)
