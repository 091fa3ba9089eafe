"""limit_core_num: run the enclosed ops on fewer compute units.

* Ascend NPU: ``torch.npu.set_stream_limit`` on the current stream (cube cores = ``op_aicore_num``,
  vector cores = ``op_vectorcore_num``), the previous limits restored on exit.
* CUDA: a green context with ``op_aicore_num`` SMs is made current inside the scope (torch's
  ``torch.cuda.green_contexts``, CUDA >= 12.8 driver). GPUs have no vector cores: the second number
  is checked but not used, which is said once per process if it is not 0. Without green-context support the
  scope runs unlimited, with one warning.
* CPU: intra-op threads (``torch.set_num_threads``) are ``op_aicore_num`` inside the scope and
  restored after; the vector-core number is checked but not used (said once, if not 0).

Inside a function compiled by ``torch.compile`` (``fullgraph=True`` included) the scope is not
applied while tracing; the graph carries it as ``npugraph_ex.scope_enter(["_op_aicore_num",
"_op_vectorcore_num"], [a, v])`` … ``npugraph_ex.scope_exit()`` for the backend to lower."""

from __future__ import annotations

import functools
import os
import threading
import warnings
from types import TracebackType
from typing import Any

import torch

from npugraph_runtime import _compat
from npugraph_runtime.devices.core_units import green_context_class, npu_limit_api
from npugraph_runtime.errors import DeviceError, PolicyError
from npugraph_runtime.scope_keys import AICORE_KEY, VECTORCORE_KEY

_warned: set[str] = set()
_warn_lock = threading.Lock()


def _warn_once(key: str, message: str) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, UserWarning, stacklevel=4)


def default_device() -> torch.device:
    """The device ``limit_core_num`` acts on when none is given: the current NPU if torch_npu is
    loaded and sees one, else the current CUDA device, else the CPU."""
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return torch.device("npu", npu.current_device())
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Read once: dynamo cannot trace os.cpu_count(), but it reads module constants.
_CPU_COUNT = os.cpu_count() or 1


def _max_cores(device_type: str, index: int) -> tuple[int, int]:
    # Also runs while dynamo traces limit_core_num: only calls dynamo constant-folds (CUDA device
    # properties) or that torch_npu registers with dynamo.
    if device_type == "cpu":
        return _CPU_COUNT, _CPU_COUNT
    if device_type == "cuda":
        sms = int(torch.cuda.get_device_properties(index).multi_processor_count)
        return sms, sms
    if device_type == "npu":
        api = npu_limit_api()
        if api is not None and api[2] is not None:
            limit = api[2](index)
            return int(limit["cube_core_num"]), int(limit["vector_core_num"])
        return 0, 0  # unknown: only the lower bound is checked
    raise DeviceError(
        f"limit_core_num does not support device type {device_type!r}; use 'cpu', 'cuda' or 'npu'"
    )


def max_core_num(device: torch.device | str | None = None) -> tuple[int, int]:
    """(largest op_aicore_num, largest op_vectorcore_num) allowed on ``device``; 0 means unknown.
    CPU: ``os.cpu_count()`` for both; CUDA: the SM count for both."""
    dev = _resolve(device)
    return _max_cores(dev.type, _index(dev))


def _resolve(device: torch.device | str | None) -> torch.device:
    if device is None:
        return default_device()
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda", "npu"):
        raise DeviceError(
            f"limit_core_num does not support device {str(dev)!r}; use 'cpu', 'cuda' or 'npu'"
        )
    return dev


def _index(dev: torch.device) -> int:
    if dev.index is not None:
        return dev.index
    if dev.type == "cuda":
        return torch.cuda.current_device()
    if dev.type == "npu":
        return int(torch.npu.current_device())  # type: ignore[attr-defined]
    return 0


def _check(name: str, value: object, lowest: int, highest: int, dev: torch.device) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and lowest <= value and (not highest or value <= highest):  # type: ignore[operator]
        return value  # type: ignore[return-value]
    upper = f"{highest} (the maximum of {dev})" if highest else "the maximum of the device"
    raise PolicyError(f"{name}={value!r} is not allowed: give an int from {lowest} to {upper}")


class _Limits(threading.local):
    def __init__(self) -> None:
        self.stack: list[tuple[str, int, int]] = []


_limits = _Limits()


def current_core_limit() -> tuple[str, int, int] | None:
    """(device type, op_aicore_num, op_vectorcore_num) of the innermost ``limit_core_num`` in force
    on this thread outside compiled code, or None."""
    return _limits.stack[-1] if _limits.stack else None


def capture_core_limit() -> tuple[str, int, int] | None:
    """The innermost limit in force that a capture records, or None; the capture manager keys
    captures on it. An NPU stream limit or a CUDA green context is part of what a device graph
    captured under it launches, so another one needs another capture. A CPU limit is not: the
    emulated graph records ops, not threads, and a replay runs them with the intra-op threads in
    force when it runs, so one capture serves every CPU limit."""
    for limit in reversed(_limits.stack):
        if limit[0] != "cpu":
            return limit
    return None


class limit_core_num:
    """Context manager: the ops inside run on at most ``op_aicore_num`` compute units (NPU cube
    cores, CUDA SMs, CPU threads) and ``op_vectorcore_num`` NPU vector cores.

    The user guarantees: both numbers are ints from 1 to the device's maximum (vector cores may be
    0 on devices without them: CPU and CUDA); no graph break inside the ``with`` when compiled;
    scopes are exited in the reverse order of entry on the thread that entered them. A value out of
    range raises ``PolicyError`` (a ``ValueError``) naming the argument and the device's maximum.

    ``device`` (keyword, optional) chooses the device; default: :func:`default_device`."""

    def __init__(
        self,
        op_aicore_num: int,
        op_vectorcore_num: int,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        dev = _resolve(device)
        ai_max, vec_max = _max_cores(dev.type, _index(dev))
        self.device = dev
        self.op_aicore_num = _check("op_aicore_num", op_aicore_num, 1, ai_max, dev)
        no_vector_cores = dev.type in ("cpu", "cuda")
        self.op_vectorcore_num = _check(
            "op_vectorcore_num", op_vectorcore_num, 0 if no_vector_cores else 1, vec_max, dev
        )
        self._restores: list[Any] = []  # a list, so one object can be entered reentrantly

    def __enter__(self) -> None:
        if _compat.compiling():
            torch.ops.npugraph_ex.scope_enter(
                [AICORE_KEY, VECTORCORE_KEY],
                [str(self.op_aicore_num), str(self.op_vectorcore_num)],
            )
            return
        kind = self.device.type
        if kind == "cpu":
            restore = self._enter_cpu()
        elif kind == "cuda":
            restore = self._enter_cuda()
        else:
            restore = self._enter_npu()
        self._restores.append(restore)
        _limits.stack.append((kind, self.op_aicore_num, self.op_vectorcore_num))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if _compat.compiling():
            torch.ops.npugraph_ex.scope_exit()
            return
        _limits.stack.pop()
        restore = self._restores.pop()
        if restore is not None:
            restore()

    def _enter_cpu(self) -> Any:
        if self.op_vectorcore_num:
            _warn_once(
                "cpu-vector",
                "limit_core_num on CPU limits intra-op threads to op_aicore_num; "
                "op_vectorcore_num does not apply to CPUs and is ignored",
            )
        saved = torch.get_num_threads()
        torch.set_num_threads(self.op_aicore_num)
        return functools.partial(torch.set_num_threads, saved)

    def _enter_cuda(self) -> Any:
        if self.op_vectorcore_num:
            _warn_once(
                "cuda-vector",
                "limit_core_num on CUDA limits SMs to op_aicore_num with a green context; "
                "op_vectorcore_num does not apply to GPUs and is ignored",
            )
        green = _green_context(_index(self.device), self.op_aicore_num)
        if green is None:
            return None
        green.set_context()
        return green.pop_context

    def _enter_npu(self) -> Any:
        api = npu_limit_api()
        if api is None:
            _warn_once(
                "npu-nolimit",
                "limit_core_num: this torch_npu has no set_stream_limit/get_stream_limit; "
                "the scope runs without a core limit (upgrade torch_npu and CANN)",
            )
            return None
        get_limit, set_limit, _ = api
        stream = torch.npu.current_stream(self.device)  # type: ignore[attr-defined]
        saved = get_limit(stream)
        set_limit(stream, self.op_aicore_num, self.op_vectorcore_num)
        return functools.partial(
            set_limit, stream, int(saved["cube_core_num"]), int(saved["vector_core_num"])
        )


_green_cache: dict[tuple[int, int], Any] = {}


def _green_context(index: int, num_sms: int) -> Any:
    """One green context per (device, SM count), created on first use and kept: creating one
    costs a driver call that is not worth repeating per scope."""
    key = (index, num_sms)
    if key in _green_cache:
        return _green_cache[key]
    cls = green_context_class()
    green = None
    if cls is None:
        _warn_once(
            "cuda-nogreen",
            "limit_core_num: this torch has no CUDA green contexts; the scope runs on all SMs "
            "(torch built with CUDA >= 12.8 is needed)",
        )
    else:
        try:
            green = cls.create(num_sms=num_sms, device_id=index)
        except RuntimeError as e:
            _warn_once(
                f"cuda-green-{num_sms}",
                f"limit_core_num: could not create a green context with {num_sms} SMs on "
                f"cuda:{index} ({e}); the scope runs on all SMs",
            )
    _green_cache[key] = green
    return green
