"""CUDA and Ascend NPU device graphs: one implementation over a torch device module.

torch_npu mirrors torch.cuda's graph API (``NPUGraph``, ``graph_pool_handle``, ``Stream``,
``Event``, ``memory_snapshot``), so ``AcceleratorBackend("cuda")`` and ``AcceleratorBackend("npu")``
differ only in the module they call. A graph uses ``torch.accelerator.Graph`` when the installed
torch has it and it can be built for the device, else the module's own class (``CUDAGraph``,
``NPUGraph``). torch_npu is imported only when "npu" is asked for."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from npugraph_runtime.devices.base import PoolHandle, check_capture_error_mode, is_raw_pool_id
from npugraph_runtime.devices.core_units import green_context_class, npu_limit_api
from npugraph_runtime.errors import CaptureError, DeviceError, PolicyError

_NPU_MISSING = (
    "the 'npu' device needs torch_npu, which is not installed or failed to import: "
    "pip install npugraph-runtime[npu] (torch_npu matching your torch), with Ascend CANN "
    "installed and its environment sourced (set_env.sh)"
)


def load_device_module(module_name: str) -> Any:
    """``torch.cuda`` or ``torch.npu`` (importing torch_npu first). ImportError for a missing
    torch_npu, DeviceError for any other name."""
    if module_name == "cuda":
        return torch.cuda
    if module_name == "npu":
        try:
            importlib.import_module("torch_npu")
        except (ImportError, OSError) as e:  # OSError: CANN libraries not found
            raise ImportError(f"{_NPU_MISSING} ({e})") from e
        module = getattr(torch, "npu", None)
        if module is None:
            raise ImportError(f"{_NPU_MISSING} (torch_npu imported but torch.npu is missing)")
        return module
    raise DeviceError(
        f"no accelerator backend for device type {module_name!r}; supported: 'cuda', 'npu' "
        "(and 'cpu' through the emulated graph)"
    )


class AcceleratorGraph:
    """One device graph of a CUDA or NPU device (the DeviceGraph protocol).

    The user guarantees what torch.cuda.CUDAGraph needs: capture runs on a side stream of
    ``device`` (``npugraph_runtime.graph`` arranges that), the captured work has no host sync, and
    every tensor the graph reads or writes stays alive, at the same address, until ``reset()``.
    """

    capture_computes = False  # a capture launches nothing

    def __init__(self, backend: AcceleratorBackend, device: torch.device,
                 *, use_accelerator_graph: bool | None = None) -> None:
        self.device = backend.normalize(device)
        self._backend = backend
        self._impl, self.uses_accelerator_graph = backend.make_torch_graph(use_accelerator_graph)
        self._capturing = False
        self._captured = False
        self._pool: PoolHandle | None = None

    @property
    def torch_graph(self) -> Any:
        """The torch graph object underneath (``torch.accelerator.Graph``, ``CUDAGraph``,
        ``NPUGraph``), for what this class does not wrap."""
        return self._impl

    def capture_begin(self, pool: PoolHandle | None = None,
                      capture_error_mode: str = "global") -> None:
        check_capture_error_mode(capture_error_mode)
        if self._capturing:
            raise CaptureError(f"capture_begin on a graph of {self.device} that is capturing "
                               "already; call capture_end() first")
        if self._captured:
            raise CaptureError(f"capture_begin on a graph of {self.device} that holds a capture; "
                               "call reset() before capturing again")
        ident = None
        if pool is not None:
            ident = self._backend.pool_ident(pool, self.device)
        with self._backend.device_guard(self.device):
            if self.uses_accelerator_graph:
                # torch.accelerator.Graph takes pool and mode as attributes read by capture_begin.
                self._impl.graph_pool = ident
                self._impl.capture_error_mode = capture_error_mode
                self._impl.capture_begin()
            else:
                self._impl.capture_begin(pool=ident, capture_error_mode=capture_error_mode)
        self._capturing = True
        if pool is not None:
            self._pool = pool if isinstance(pool, PoolHandle) else PoolHandle(self.device, ident)

    def capture_end(self) -> None:
        if not self._capturing:
            raise CaptureError(f"capture_end on a graph of {self.device} that is not capturing")
        self._capturing = False
        with self._backend.device_guard(self.device):
            self._impl.capture_end()
        self._captured = True
        if self._pool is None:
            self._pool = PoolHandle(self.device, tuple(self._impl.pool()))

    def replay(self) -> None:
        if not self._captured:
            raise CaptureError(
                f"replay of a graph of {self.device} that "
                + ("is still capturing" if self._capturing else "was never captured (or was reset)")
            )
        self._impl.replay()

    def reset(self) -> None:
        if self._capturing:
            raise CaptureError(f"reset of a graph of {self.device} while it is capturing; "
                               "call capture_end() first")
        self._impl.reset()
        self._captured = False
        self._pool = None

    def pool(self) -> PoolHandle:
        """The pool this graph allocated from: the one given to capture_begin, or its private one."""
        if self._pool is None:
            if not self._capturing:
                raise CaptureError(f"pool() of a graph of {self.device} that was never captured")
            self._pool = PoolHandle(self.device, tuple(self._impl.pool()))
        return self._pool

    def enable_debug_mode(self) -> None:
        """Keep what ``debug_dump`` needs; call before ``capture_begin``."""
        self._impl.enable_debug_mode()

    def debug_dump(self, path: str) -> None:
        """Write the captured graph to ``path`` (CUDA: a GraphViz .dot file; NPU: aclgraph's JSON,
        the input of the deadlock check). Needs ``enable_debug_mode()`` before the capture."""
        if not self._captured:
            raise CaptureError(f"debug_dump of a graph of {self.device} that was never captured")
        self._impl.debug_dump(path)

    def __repr__(self) -> str:
        state = "capturing" if self._capturing else "captured" if self._captured else "empty"
        return f"AcceleratorGraph(device={self.device}, {state})"


class AcceleratorBackend:
    """DeviceBackend and StreamBackend of one torch device module ("cuda" or "npu")."""

    capture_computes = False

    def __init__(self, module_name: str, *, module: Any = None) -> None:
        """``module``: the torch device module to drive instead of ``torch.<module_name>`` (a
        stand-in for hardware a test machine lacks)."""
        self.type = module_name
        self.module = load_device_module(module_name) if module is None else module
        if not self.module.is_available():
            raise DeviceError(
                f"device type {module_name!r} was asked for but torch.{module_name}.is_available() "
                f"is False here (torch {torch.__version__}); use 'cpu' or run on a machine with "
                f"a {module_name.upper()} device"
            )

    # --- devices ------------------------------------------------------------------------------
    def normalize(self, device: torch.device | str | int | None) -> torch.device:
        if device is None:
            return torch.device(self.type, self.module.current_device())
        dev = torch.device(self.type, device) if isinstance(device, int) else torch.device(device)
        if dev.type != self.type:
            raise DeviceError(f"device {str(dev)!r} given to the {self.type} backend")
        if dev.index is None:
            dev = torch.device(self.type, self.module.current_device())
        count = self.module.device_count()
        if not 0 <= dev.index < count:  # type: ignore[operator]
            raise DeviceError(f"device {str(dev)!r} does not exist: this machine has {count} "
                              f"{self.type} device(s), {self.type}:0 to {self.type}:{count - 1}")
        return dev

    @contextmanager
    def device_guard(self, device: torch.device) -> Iterator[None]:
        with self.module.device(device.index):
            yield

    # --- graphs -------------------------------------------------------------------------------
    def make_torch_graph(self, use_accelerator_graph: bool | None = None) -> tuple[Any, bool]:
        """A fresh torch graph object and whether it is a ``torch.accelerator.Graph``. ``None``
        prefers torch.accelerator.Graph when this torch has it for this device."""
        accel = getattr(getattr(torch, "accelerator", None), "Graph", None)
        if use_accelerator_graph is not False and accel is not None and self._is_current_accelerator():
            try:
                return accel(), True
            except RuntimeError:
                if use_accelerator_graph:
                    raise
        elif use_accelerator_graph:
            raise DeviceError(f"torch.accelerator.Graph is not available for {self.type} "
                              f"with torch {torch.__version__}")
        cls = getattr(self.module, "CUDAGraph" if self.type == "cuda" else "NPUGraph", None)
        if cls is None:
            raise DeviceError(f"torch.{self.type} has no graph class in this version; "
                              "upgrade torch / torch_npu")
        return cls(), False

    def _is_current_accelerator(self) -> bool:
        accelerator = getattr(torch, "accelerator", None)
        current = getattr(accelerator, "current_accelerator", None)
        if current is None:
            return False
        found = current()
        return found is not None and found.type == self.type

    def new_graph(self, device: torch.device) -> AcceleratorGraph:
        return AcceleratorGraph(self, device)

    def graph_pool_handle(self, device: torch.device) -> PoolHandle:
        dev = self.normalize(device)
        with self.device_guard(dev):
            return PoolHandle(dev, tuple(self.module.graph_pool_handle()))

    def pool_ident(self, pool: object, device: torch.device) -> tuple[int, int]:
        """The allocator's ``(int, int)`` id of ``pool``: our PoolHandle of this device, or the
        device's own handle (what ``torch.cuda.graph_pool_handle()`` returns)."""
        if isinstance(pool, PoolHandle):
            if pool.device.type != self.type or (pool.device.index not in (None, device.index)):
                raise DeviceError(f"a pool of {pool.device} cannot be used by a graph of {device}; "
                                  f"get one with graph_pool_handle({str(device)!r})")
            pool = pool.ident
        if is_raw_pool_id(pool):
            return (pool[0], pool[1])
        raise PolicyError(f"pool={pool!r} is not a {self.type} pool: give a handle from "
                          "npugraph_runtime.graph_pool_handle(), a graph's pool(), or "
                          f"torch.{self.type}.graph_pool_handle()")

    def pool_bytes(self, pool: PoolHandle) -> int:
        """Bytes the allocator holds in segments of ``pool`` now (reserved, on pool.device)."""
        dev = self.normalize(pool.device)
        ident = self.pool_ident(pool, dev)
        try:
            segments = self.module.memory_snapshot(include_traces=False)
        except TypeError:  # torch < 2.12 has no include_traces
            segments = self.module.memory_snapshot()
        total = 0
        for seg in segments:
            if tuple(seg.get("segment_pool_id", ())) == ident and seg.get("device", dev.index) == dev.index:
                total += int(seg["total_size"])
        return total

    def synchronize(self, device: torch.device) -> None:
        self.module.synchronize(self.normalize(device))

    def core_limit_kind(self, device: torch.device) -> str | None:
        """NPU: "stream_limit", CUDA: "green_context"; None when this torch cannot limit it."""
        if self.type == "npu":
            return "stream_limit" if npu_limit_api() is not None else None
        if self.type == "cuda":
            return "green_context" if green_context_class() is not None else None
        return None

    def capabilities(self, device: torch.device) -> dict[str, object]:
        dev = self.normalize(device)
        with self.device_guard(dev):
            graph, accel = self.make_torch_graph()
        graph_class = "torch.accelerator.Graph" if accel else f"{type(graph).__module__}.{type(graph).__qualname__}"
        caps: dict[str, object] = {
            "graphs": True,
            "graph_class": graph_class,
            "core_limit": self.core_limit_kind(dev),
            "task_update": self.type == "npu"
            and hasattr(self.module, "graph_task_update_begin"),
            "pool_sharing": True,
            "streams": True,
            "debug_dump": hasattr(graph, "debug_dump"),
            "collectives": self.collective_backend(),
            "name": str(self.module.get_device_name(dev.index)),
        }
        props = self.module.get_device_properties(dev.index)
        for attr, key in (("total_memory", "total_memory"), ("multi_processor_count", "sm_count")):
            if hasattr(props, attr):
                caps[key] = int(getattr(props, attr))
        return caps

    def collective_backend(self) -> str:
        """The torch.distributed backend whose collectives a graph of this device captures
        ("nccl", "hccl"), or "none". What they need is what the capture manager already does:
        an eager warm-up run before the first capture creates the communicators and the P2P
        connections (both allocate, which a capture cannot), and the capture runs on a side
        stream. ProcessGroupNCCL keeps work issued during a capture away from its watchdog, and
        since torch 2.7 the watchdog queries events in thread-local capture mode, so "global"
        capture_error_mode works with NCCL (checked on torch 2.11 and 2.13). HCCL is torch_npu's,
        registered when torch_npu is imported."""
        import torch.distributed as dist

        if not dist.is_available():
            return "none"
        if self.type == "cuda":
            return "nccl" if dist.is_nccl_available() else "none"
        backends = getattr(dist.Backend, "backend_list", ())
        return "hccl" if "hccl" in backends else "none"

    # --- streams ------------------------------------------------------------------------------
    def new_stream(self, device: torch.device) -> Any:
        return self.module.Stream(device=self.normalize(device))

    def current_stream(self, device: torch.device) -> Any:
        return self.module.current_stream(self.normalize(device))

    def set_stream(self, stream: Any) -> None:
        self.module.set_stream(stream)

    def new_event(self, device: torch.device) -> Any:
        # Device events bind to a device when first recorded.
        return self.module.Event()
