"""Errors of the passes. Each message names the pass so the user knows which one to fix or turn off."""

from __future__ import annotations

from npugraph_runtime.errors import NpugraphError


class PassError(NpugraphError):
    """A graph pass raised. ``pass_name`` names it; the original exception is the ``__cause__``."""

    def __init__(self, pass_name: str, message: str) -> None:
        super().__init__(message)
        self.pass_name = pass_name


class PassConfigError(NpugraphError, TypeError):
    """A pass or pass option of the wrong type (a pass that is not callable, a built-in's switch
    that is not a bool). A TypeError too, so ``except TypeError`` keeps catching it."""
