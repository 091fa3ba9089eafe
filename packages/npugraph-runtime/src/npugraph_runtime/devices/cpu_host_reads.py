"""Host reads of tensor values that bypass ATen dispatch (``tolist``, printing, ``torch.tensor``
of a list of tensors): refused during a CPU capture, or frozen in relaxed mode."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from npugraph_runtime.devices.cpu_record import tensor_list
from npugraph_runtime.errors import CaptureError, NpugraphError


class Reading(Protocol):
    """What HostReads asks of the recorder it serves."""

    error: NpugraphError | None
    mode: str
    local: set[int]
    frozen: list[str]

    def reads_local(self, tensors: list[torch.Tensor]) -> bool: ...

    def local_read(self, what: str) -> CaptureError: ...

    def fail(self, error: NpugraphError) -> None: ...


# Tensor methods that read values on the host without dispatching an ATen op (so the dispatch
# mode never sees them): a replay would repeat what they read at capture.
_HOST_READ_METHODS = {
    torch.Tensor.tolist: "Tensor.tolist()",
    torch.Tensor.numpy: "Tensor.numpy()",
    torch.Tensor.__array__: "Tensor.__array__() (numpy conversion)",
    torch.Tensor.__repr__: "Tensor.__repr__() (printing a tensor)",
    torch.Tensor.__format__: "Tensor.__format__() (formatting a tensor)",
}
# Constructors that read the values of tensors nested in their data argument on the host.
_CONSTRUCTORS = {torch.tensor: "torch.tensor", torch.as_tensor: "torch.as_tensor",
                 torch.asarray: "torch.asarray"}


def _nests_tensor(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and any(
        isinstance(v, torch.Tensor) or _nests_tensor(v) for v in value
    )


class HostReads(TorchFunctionMode):
    """Refuses, during a capture, the host reads of tensor values that bypass ATen dispatch:
    on the CPU they succeed silently and every replay would repeat the values they read."""

    def __init__(self, recorder: Reading) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        recorder = self.recorder
        if recorder.error is None:
            what = _HOST_READ_METHODS.get(func)
            if what is None and func in _CONSTRUCTORS:
                data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
                if _nests_tensor(data):
                    what = f"{_CONSTRUCTORS[func]}() of a list holding tensors"
            if what is not None:
                if recorder.mode == "relaxed":
                    if recorder.local and recorder.reads_local(tensor_list(args, kwargs)):
                        error = recorder.local_read(what)
                        recorder.fail(error)
                        raise error
                    recorder.frozen.append(what)
                else:
                    error = CaptureError(
                        f"{what} cannot be captured: it reads tensor values on the host, and "
                        "every replay would repeat the values it read during capture. Move it out "
                        "of the captured region, or capture with capture_error_mode='relaxed' to "
                        f"accept that (mode is {recorder.mode!r})"
                    )
                    recorder.fail(error)
                    raise error
        return func(*args, **kwargs)
