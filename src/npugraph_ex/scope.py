"""Scopes usable inside a compiled function (``fullgraph=True`` included), and eagerly.

* ``stream(tag)``: the enclosed ops run on the stream named ``tag`` (one stream per tag and device,
  created on first use; ``None`` stays on the current stream);
* ``wait(tensors)``: the ops after it, on the current stream, run after the ops that made
  ``tensors`` (on whatever stream they ran);
* ``record()``: a token of this point of the current stream; ``wait([token])`` orders after it;
* ``limit_core_num(op_aicore_num, op_vectorcore_num)`` limits the compute units the enclosed ops
  may use (NPU: per-stream AI Core / Vector Core limits; CUDA: SMs; CPU: intra-op threads).

In a compiled graph every side stream is forked from and joined back into the capture stream by
the backend; the user orders what one stream writes and another reads with ``record``/``wait``
(on the CPU, a capture warns with ``CrossStreamWarning`` when that order is missing). No graph
break may fall inside a ``with`` block."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import npugraph_runtime as ngr
import torch
from npugraph_runtime.core_limit import limit_core_num
from npugraph_runtime.errors import NpugraphError
from npugraph_runtime.ops import USER_STREAM_LABEL
from npugraph_runtime.streams import compiling

__all__ = ["limit_core_num", "record", "stream", "wait"]


@contextmanager
def stream(tag: str | None, device: torch.device | str | None = None) -> Iterator[None]:
    """Run the body on the stream named ``tag`` (of ``device``, default: the current
    accelerator, else the CPU)."""
    if tag is None:
        yield
        return
    if not isinstance(tag, str) or not tag:
        raise NpugraphError(f"stream tag {tag!r} is not allowed: give a non-empty str")
    if compiling():
        torch.ops.npugraph_ex.scope_enter([USER_STREAM_LABEL], [tag])
        try:
            yield
        finally:
            torch.ops.npugraph_ex.scope_exit()
        return
    with ngr.stream(ngr.user_stream(tag, device)):
        yield


def record() -> torch.Tensor:
    """A token of this point of the current stream, for :func:`wait`."""
    token: torch.Tensor = torch.ops.npugraph_ex.record()
    return token


def wait(tensors: Sequence[torch.Tensor]) -> None:
    """The current stream waits for the ops that made ``tensors`` (tokens of :func:`record`
    included). Eagerly on one device's streams this orders nothing more than program order does
    on the CPU; compiled, the backend turns it into events of the graph."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    torch.ops.npugraph_ex.wait(list(tensors))
