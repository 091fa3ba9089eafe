"""Pending: lands in the next commit of issue 4."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx


def inplace_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
    """Pending (issue 4): leaves the graph unchanged for now."""


def input_inplace_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
    """Pending (issue 4): leaves the graph unchanged for now."""
