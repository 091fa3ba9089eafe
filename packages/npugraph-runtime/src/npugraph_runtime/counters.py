"""What a GraphedCallable reports: capture events, counters and log lines.

Counters live in ``torch._dynamo.utils.counters["npugraph_ex"]`` (as in the reference), named
``<stem>_<callable name>``. A counter exists only while it is positive: an event that did not
happen, and ``captured_<name>`` of a callable that holds no graph (a fallback, a reset, every
capture released), leave no entry, so a check such as ``any(k.startswith("captured_") ...)`` can
never pass on a counter at 0. Nothing here runs on the replay path: every counter name is built
once per callable, and every log call formats lazily."""

from __future__ import annotations

import itertools
import logging
from typing import NamedTuple

from npugraph_runtime import _compat

logger = logging.getLogger("npugraph_ex")

NEW_KEY = "new_key"
FORCE_RECAPTURE = "force_recapture"
MUTATED_INPUT_CHANGE = "mutated_input_change"
STATIC_INPUT_CHANGE = "static_input_change"
CORE_LIMIT_CHANGE = "core_limit_change"
RECAPTURE_REASONS = (FORCE_RECAPTURE, MUTATED_INPUT_CHANGE, STATIC_INPUT_CHANGE, CORE_LIMIT_CHANGE)
# one more capture of a key, beside the others: the caller still holds the outputs of every
# capture of the key (counter capture_due_to_held_outputs_<name>)
HELD_OUTPUTS = "held_outputs"

CAPTURE_LIMIT = "capture_limit"
FORCE_EAGER = "force_eager"
UNSAFE_OP = "unsafe_op"
FALLBACK_REASONS = (CAPTURE_LIMIT, FORCE_EAGER, UNSAFE_OP)
# a graph the backend runs eagerly because it needs gradients: it never reaches a callable, so
# its counter carries no callable name
REQUIRES_GRAD = "requires_grad"


def fallback_counter(reason: str, name: str | None = None) -> str:
    """The counter of eager fallbacks for ``reason``: ``eager_fallback_due_to_<reason>[_<name>]``."""
    return f"eager_fallback_due_to_{reason}" + ("" if name is None else f"_{name}")

_graph_numbers = itertools.count(1)


def default_name() -> str:
    """``graph_<n>``, n counting every unnamed callable of the process and every graph the
    backend names (one counter, so that no two share the counters named after them)."""
    return f"graph_{next(_graph_numbers)}"


def _add(key: str, n: int = 1) -> None:
    if n:
        _compat.npugraph_ex_counters()[key] += n


def _set(key: str, n: int) -> None:
    counters = _compat.npugraph_ex_counters()
    if n:
        counters[key] = n
    else:
        counters.pop(key, None)


class CaptureEvent(NamedTuple):
    """One capture: the graph key it was for and why (``"new_key"`` or a recapture reason)."""

    key: tuple[object, ...]
    reason: str


class CounterNames:
    """The counter keys of one callable, spelled once."""

    def __init__(self, name: str) -> None:
        self.captured = f"captured_{name}"
        self.new_key = f"capture_due_to_new_key_{name}"
        self.recapture = {r: f"recapture_due_to_{r}_{name}" for r in RECAPTURE_REASONS}
        self.fallback = {r: fallback_counter(r, name) for r in FALLBACK_REASONS}
        self.held = f"capture_due_to_held_outputs_{name}"
        # calls run eagerly because every capture of their key had outputs held and the
        # capture_limit left no room for another
        self.held_eager = f"eager_call_due_to_held_outputs_{name}"
        # calls run eagerly because they need autograd (grad mode on, an input requiring grad)
        self.grad_eager = f"eager_call_due_to_{REQUIRES_GRAD}_{name}"
        # captures released because nothing but them held one of their parameters
        self.released = f"released_orphaned_{name}"
        # inputs that came at a new address on every call, copied from then on
        self.copied = f"copied_inputs_{name}"
        # captures made ahead of the call that needs them (capture_ahead), counted as new keys too
        self.ahead = f"capture_ahead_{name}"
        # milliseconds spent capturing, warm-up runs included (what a slow first step paid for)
        self.capture_ms = f"capture_ms_{name}"

    def count_capture(self, reason: str, captured_now: int) -> None:
        if reason == NEW_KEY:
            _add(self.new_key)
        elif reason == HELD_OUTPUTS:
            _add(self.held)
        else:
            _add(self.recapture[reason])
        _set(self.captured, captured_now)

    def count_released(self, released: int, captured_now: int) -> None:
        _add(self.released, released)
        _set(self.captured, captured_now)

    def count_reset(self) -> None:
        _set(self.captured, 0)

    def count_copied(self, inputs: int) -> None:
        _add(self.copied, inputs)

    def count_ahead(self) -> None:
        _add(self.ahead)

    def count_capture_time(self, seconds: float) -> None:
        _add(self.capture_ms, max(1, round(seconds * 1e3)))

    def count_held_eager(self) -> None:
        _add(self.held_eager)

    def count_grad_eager(self) -> None:
        _add(self.grad_eager)

    def count_fallback(self, reason: str) -> None:
        _add(self.fallback[reason])
        _set(self.captured, 0)
