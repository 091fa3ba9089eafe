"""Errors of the runtime. Each message says what the user should change."""

from __future__ import annotations


class NpugraphError(RuntimeError):
    """Base class of every runtime error raised by npugraph-ex."""


class CaptureError(NpugraphError):
    """An operation cannot be captured into a device graph (host sync, data-dependent shape, RNG,
    cross-device copy), or the capture was used wrongly (replay before capture, nested capture)."""


class DeviceError(NpugraphError, ValueError):
    """A device that npugraph-ex does not support, or tensors of two devices in one capture."""


class PolicyError(NpugraphError, ValueError):
    """A capture policy or argument with a value that is not allowed (a ValueError too, so
    ``except ValueError`` keeps catching it)."""


class CrossStreamWarning(UserWarning):
    """A tensor produced on one stream is used on another with no event between them."""
