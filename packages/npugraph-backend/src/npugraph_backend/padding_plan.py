"""What a padded call needs at run time (``PaddingPlan``, plain data that a saved graph keeps) and
what the backend reads from the Dynamo graph for it (``ArgumentNames``). Kept apart from
``padding_analysis``, which only a compile imports: a warm start loads a plan without it."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx

from npugraph_backend import _compat
from npugraph_backend.config import CompilerConfig


@dataclass(frozen=True)
class PaddedInput:
    slot: int
    dims: tuple[tuple[int, int], ...]  # (dim, padded symbol index)
    pad: int | float | bool | None  # None: repeat the last real row
    mutated: bool


@dataclass(frozen=True)
class PaddingPlan:
    """What the padded call (padding.py) needs, as plain data."""

    sizes: tuple[int, ...]
    symbols: tuple[str, ...]
    locate: tuple[tuple[int, int | None], ...]  # per symbol: (slot, tensor dim or None: an int)
    inputs: tuple[PaddedInput, ...]
    int_slots: tuple[tuple[int, int], ...]  # (slot, symbol index) of int inputs equal to a symbol
    outputs: tuple[tuple[tuple[int, int, int], ...], ...]  # per output: (dim, symbol, factor)
    # capture every size on the first call that needs one, largest first (declared sizes; not
    # "auto", whose ladder to 256 is more than most servers meet)
    ahead: bool = False


@dataclass(frozen=True)
class ArgumentNames:
    """What the Dynamo graph knows and the AOT graph does not: per Dynamo input, the forward
    argument it is; the forward's argument names reaching the graph; whether torch.compile was
    told dynamic=False."""

    inputs: tuple[str | None, ...]
    arguments: tuple[str, ...]
    dynamic_off: bool
    labels: tuple[str | None, ...] = ()


def argument_names(gm: torch.fx.GraphModule, config: CompilerConfig) -> ArgumentNames | None:
    """Read from a Dynamo graph, inside the backend call (None when capture_sizes is off)."""
    if config.capture_sizes is None:
        return None
    return ArgumentNames(_compat.dynamo_input_names(gm), _compat.dynamo_argument_names(gm),
                         _compat.dynamic_shapes_off(), _compat.dynamo_input_labels(gm))
