"""The CUDA/NPU backend (devices/accelerator.py). GPU tests are marked ``cuda`` and skip without a
GPU; they drive ``AcceleratorBackend`` directly, the way ``npugraph_runtime.graph`` does."""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import npugraph_runtime as ngr
import pytest
import torch
from npugraph_runtime.devices.accelerator import AcceleratorBackend, AcceleratorGraph
from npugraph_runtime.devices.base import PoolHandle
from npugraph_runtime.errors import CaptureError, DeviceError, PolicyError

HAS_CUDA = torch.cuda.is_available()


# --- without a device ---------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu installed")
def test_npu_without_torch_npu_names_the_extra_and_cann() -> None:
    with pytest.raises(ImportError, match=r"pip install npugraph-runtime\[npu\]") as info:
        AcceleratorBackend("npu")
    assert "CANN" in str(info.value)


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu installed")
@pytest.mark.parametrize("make", [ngr.Graph, ngr.graph_pool_handle, ngr.Stream, ngr.Event])
def test_public_api_on_npu_without_torch_npu_names_the_extra(make: Any) -> None:
    # torch cannot even parse "npu" before torch_npu is imported: the message must still say how
    with pytest.raises(ImportError, match=r"pip install npugraph-runtime\[npu\]"):
        make("npu:0")


@pytest.mark.skipif(HAS_CUDA, reason="a GPU is present")
def test_cuda_without_a_gpu_is_a_device_error() -> None:
    with pytest.raises(DeviceError, match="is_available"):
        AcceleratorBackend("cuda")


def test_an_unknown_module_is_a_device_error() -> None:
    with pytest.raises(DeviceError, match="'xpu'"):
        AcceleratorBackend("xpu")


# --- the backend's own logic, over a stand-in device module --------------------------------------
# A mock of hardware this machine lacks: it records what the backend asks torch.cuda to do, so the
# state checks, pool bookkeeping and snapshot filtering are tested everywhere.
class _FakeGraph:
    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.replays = 0

    def capture_begin(self, pool: object = None, capture_error_mode: str = "global") -> None:
        self.calls.append(("capture_begin", pool, capture_error_mode))

    def capture_end(self) -> None:
        self.calls.append(("capture_end",))

    def replay(self) -> None:
        self.replays += 1

    def reset(self) -> None:
        self.calls.append(("reset",))

    def pool(self) -> tuple[int, int]:
        return (7, 0)


class _FakeCuda:
    CUDAGraph = _FakeGraph

    def __init__(self, segments: list[dict[str, object]] | None = None,
                 with_include_traces: bool = True) -> None:
        self.segments = segments or []
        self.with_include_traces = with_include_traces

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 2

    def device(self, index: int) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def graph_pool_handle(self) -> tuple[int, int]:
        return (0, 42)

    def memory_snapshot(self, **kwargs: object) -> list[dict[str, object]]:
        if kwargs and not self.with_include_traces:
            raise TypeError("memory_snapshot() got an unexpected keyword argument")
        return self.segments


def _fake_backend(**kwargs: object) -> AcceleratorBackend:
    return AcceleratorBackend("cuda", module=_FakeCuda(**kwargs))  # type: ignore[arg-type]


def test_graph_misuse_is_refused_before_reaching_the_device() -> None:
    graph = _fake_backend().new_graph(torch.device("cuda"))
    with pytest.raises(CaptureError, match="never captured"):
        graph.replay()
    with pytest.raises(CaptureError, match="not capturing"):
        graph.capture_end()
    with pytest.raises(CaptureError, match="never captured"):
        graph.pool()
    with pytest.raises(PolicyError, match="capture_error_mode='lenient'"):
        graph.capture_begin(capture_error_mode="lenient")
    graph.capture_begin(capture_error_mode="relaxed")
    with pytest.raises(CaptureError, match="capturing already"):
        graph.capture_begin()
    with pytest.raises(CaptureError, match="while it is capturing"):
        graph.reset()
    with pytest.raises(CaptureError, match="still capturing"):
        graph.replay()
    graph.capture_end()
    with pytest.raises(CaptureError, match="call reset"):
        graph.capture_begin()
    graph.replay()
    graph.reset()
    with pytest.raises(CaptureError, match="never captured"):
        graph.replay()
    assert graph.torch_graph.calls == [("capture_begin", None, "relaxed"), ("capture_end",),
                                       ("reset",)]
    assert graph.torch_graph.replays == 1


def test_a_given_pool_is_passed_to_the_device_and_reported_by_pool() -> None:
    backend = _fake_backend()
    device = torch.device("cuda", 1)
    pool = backend.graph_pool_handle(device)
    assert pool == PoolHandle(device, (0, 42))
    graph = backend.new_graph(device)
    graph.capture_begin(pool=pool)
    graph.capture_end()
    assert graph.torch_graph.calls[0] == ("capture_begin", (0, 42), "global")
    assert graph.pool() is pool


def test_a_raw_device_pool_is_reported_as_a_pool_handle() -> None:
    graph = _fake_backend().new_graph(torch.device("cuda"))
    graph.capture_begin(pool=(0, 42))  # type: ignore[arg-type]
    graph.capture_end()
    assert graph.pool() == PoolHandle(torch.device("cuda", 0), (0, 42))


def test_without_a_pool_the_graph_reports_its_private_pool() -> None:
    graph = _fake_backend().new_graph(torch.device("cuda"))
    graph.capture_begin()
    graph.capture_end()
    assert graph.pool() == PoolHandle(torch.device("cuda", 0), (7, 0))


def test_pools_of_other_devices_or_kinds_are_refused() -> None:
    backend = _fake_backend()
    graph = backend.new_graph(torch.device("cuda", 0))
    with pytest.raises(DeviceError, match="cannot be used by a graph of cuda:0"):
        graph.capture_begin(pool=PoolHandle(torch.device("cuda", 1), (0, 1)))
    with pytest.raises(DeviceError, match="cannot be used"):
        graph.capture_begin(pool=PoolHandle(torch.device("cpu"), 3))
    with pytest.raises(PolicyError, match="not a cuda pool"):
        graph.capture_begin(pool=(1, 2, 3))  # type: ignore[arg-type]
    assert graph.torch_graph.calls == []


def test_devices_that_do_not_exist_are_refused() -> None:
    backend = _fake_backend()
    with pytest.raises(DeviceError, match="has 2 cuda device"):
        backend.new_graph(torch.device("cuda", 5))
    with pytest.raises(DeviceError, match="given to the cuda backend"):
        backend.new_graph(torch.device("cpu"))


@pytest.mark.parametrize("with_include_traces", [True, False])
def test_pool_bytes_counts_the_segments_of_that_pool_on_that_device(
    with_include_traces: bool,
) -> None:
    segments: list[dict[str, object]] = [
        {"device": 0, "segment_pool_id": (0, 42), "total_size": 2 << 20},
        {"device": 0, "segment_pool_id": (0, 42), "total_size": 20 << 20},
        {"device": 1, "segment_pool_id": (0, 42), "total_size": 1 << 20},
        {"device": 0, "segment_pool_id": (7, 0), "total_size": 4 << 20},
        {"device": 0, "segment_pool_id": (0, 0), "total_size": 8 << 20},
    ]
    backend = _fake_backend(segments=segments, with_include_traces=with_include_traces)
    assert backend.pool_bytes(PoolHandle(torch.device("cuda", 0), (0, 42))) == 22 << 20
    assert backend.pool_bytes(PoolHandle(torch.device("cuda", 1), (0, 42))) == 1 << 20
    assert backend.pool_bytes(PoolHandle(torch.device("cuda", 0), (9, 9))) == 0


# --- CUDA ---------------------------------------------------------------------------------------
def _graph_kinds() -> list[bool]:
    kinds = [False]
    if hasattr(getattr(torch, "accelerator", None), "Graph"):
        kinds.append(True)
    return kinds


@pytest.fixture
def backend() -> AcceleratorBackend:
    return AcceleratorBackend("cuda")


@pytest.fixture
def side_stream() -> Iterator[torch.cuda.Stream]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    yield stream
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def _mlp(width: int = 256) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width),
        torch.nn.LayerNorm(width),
    ).cuda().eval()


def _capture(graph: AcceleratorGraph, stream: torch.cuda.Stream, fn: Callable[[], torch.Tensor],
             pool: PoolHandle | None = None) -> torch.Tensor:
    with torch.cuda.stream(stream):
        fn()  # warm up: lazy init (cuBLAS handles) must not happen during capture
    stream.synchronize()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            out = fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return out


@pytest.mark.parametrize("use_accelerator_graph", _graph_kinds())
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
@torch.inference_mode()
def test_mlp_replay_equals_eager_after_new_inputs(
    backend: AcceleratorBackend, side_stream: torch.cuda.Stream, use_accelerator_graph: bool
) -> None:
    model = _mlp()
    static_in = torch.randn(32, 256, device="cuda")
    graph = AcceleratorGraph(backend, torch.device("cuda"),
                             use_accelerator_graph=use_accelerator_graph)
    assert graph.uses_accelerator_graph is use_accelerator_graph
    static_out = _capture(graph, side_stream, lambda: model(static_in))
    address = static_out.data_ptr()
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(32, 256, device="cuda")
        static_in.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out, model(x))
        assert static_out.data_ptr() == address


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
@torch.inference_mode()
def test_public_graph_api_captures_and_replays_on_cuda() -> None:
    model = _mlp()
    static_in = torch.randn(16, 256, device="cuda")
    model(static_in)  # warm up outside the capture
    pool = ngr.graph_pool_handle("cuda")
    g = ngr.Graph("cuda")
    assert isinstance(g, AcceleratorGraph)
    with ngr.graph(g, pool=pool):
        static_out = model(static_in)
    assert g.pool() == pool and ngr.pool_bytes(pool) > 0
    for seed in range(2):
        torch.manual_seed(seed)
        x = torch.randn(16, 256, device="cuda")
        static_in.copy_(x)
        g.replay()
        ngr.synchronize("cuda")
        torch.testing.assert_close(static_out, model(x))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
@torch.inference_mode()
def test_in_place_update_happens_once_per_replay(
    backend: AcceleratorBackend, side_stream: torch.cuda.Stream
) -> None:
    counter = torch.zeros(4, device="cuda")
    step = torch.ones(4, device="cuda")
    graph = backend.new_graph(torch.device("cuda"))
    _capture(graph, side_stream, lambda: counter.add_(step))
    counter.zero_()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(counter, torch.full((4,), 5.0, device="cuda"))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
@torch.inference_mode()
def test_graphs_in_one_pool_share_it_and_hold_less_than_private_pools(
    backend: AcceleratorBackend, side_stream: torch.cuda.Stream
) -> None:
    model = _mlp(512)
    sizes = (64, 32, 16)
    device = torch.device("cuda")

    def capture_all(pool: PoolHandle | None) -> tuple[list[AcceleratorGraph], list[torch.Tensor],
                                                        list[torch.Tensor]]:
        graphs, ins, outs = [], [], []
        for n in sizes:
            graph = backend.new_graph(device)
            static_in = torch.randn(n, 512, device="cuda")
            outs.append(_capture(graph, side_stream, lambda x=static_in: model(x), pool=pool))
            graphs.append(graph)
            ins.append(static_in)
        return graphs, ins, outs

    shared_pool = backend.graph_pool_handle(device)
    shared, shared_in, shared_out = capture_all(shared_pool)
    assert all(g.pool() == shared_pool for g in shared)
    shared_bytes = backend.pool_bytes(shared_pool)

    private, _, _ = capture_all(None)
    private_pools = [g.pool() for g in private]
    assert len({p.ident for p in private_pools}) == len(sizes)
    private_bytes = sum(backend.pool_bytes(p) for p in private_pools)
    assert 0 < shared_bytes < private_bytes

    for graph, static_in, static_out in zip(shared, shared_in, shared_out, strict=True):
        x = torch.randn_like(static_in)
        static_in.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out, model(x))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
def test_torch_pool_handles_are_accepted(backend: AcceleratorBackend) -> None:
    raw = torch.cuda.graph_pool_handle()
    assert backend.pool_ident(raw, torch.device("cuda", 0)) == tuple(raw)
    with pytest.raises(DeviceError, match="cannot be used"):
        backend.pool_ident(PoolHandle(torch.device("cpu"), 1), torch.device("cuda", 0))
    with pytest.raises(PolicyError, match="not a cuda pool"):
        backend.pool_ident("shared", torch.device("cuda", 0))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
def test_misuse_of_a_graph_is_a_capture_error(
    backend: AcceleratorBackend, side_stream: torch.cuda.Stream
) -> None:
    graph = backend.new_graph(torch.device("cuda"))
    with pytest.raises(CaptureError, match="never captured"):
        graph.replay()
    with pytest.raises(CaptureError, match="not capturing"):
        graph.capture_end()
    with pytest.raises(PolicyError, match="capture_error_mode"):
        graph.capture_begin(capture_error_mode="lenient")
    x = torch.ones(8, device="cuda")
    with torch.cuda.stream(side_stream):
        graph.capture_begin()
        y = x * 2
        with pytest.raises(CaptureError, match="capturing already"):
            graph.capture_begin()
        with pytest.raises(CaptureError, match="while it is capturing"):
            graph.reset()
        graph.capture_end()
    with pytest.raises(CaptureError, match="reset"):
        graph.capture_begin()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2)
    graph.reset()
    with pytest.raises(CaptureError, match="never captured"):
        graph.replay()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
@torch.inference_mode()
def test_events_order_work_across_streams(backend: AcceleratorBackend) -> None:
    device = torch.device("cuda")
    producer, consumer = backend.new_stream(device), backend.new_stream(device)
    done = backend.new_event(device)
    a = torch.randn(1024, 1024, device="cuda")
    with torch.cuda.stream(producer):
        b = a @ a
        done.record(producer)
    consumer.wait_event(done)
    with torch.cuda.stream(consumer):
        c = b.relu().sum()
    torch.cuda.synchronize()
    torch.testing.assert_close(c, (a @ a).relu().sum())


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
@torch.inference_mode()
def test_a_forked_side_stream_is_captured_and_replayed(
    backend: AcceleratorBackend, side_stream: torch.cuda.Stream
) -> None:
    device = torch.device("cuda")
    branch = backend.new_stream(device)
    x = torch.randn(256, 256, device="cuda")

    def two_branches() -> torch.Tensor:
        fork, join = backend.new_event(device), backend.new_event(device)
        fork.record(backend.current_stream(device))
        branch.wait_event(fork)
        left = x @ x
        with torch.cuda.stream(branch):
            right = x.sin() * 3
            join.record(branch)
        backend.current_stream(device).wait_event(join)
        return left + right

    graph = backend.new_graph(device)
    out = _capture(graph, side_stream, two_branches)
    for seed in range(2):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, x @ x + x.sin() * 3)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
def test_capabilities_describe_the_gpu(backend: AcceleratorBackend) -> None:
    caps = backend.capabilities(torch.device("cuda"))
    assert caps["graphs"] is True and caps["pool_sharing"] is True
    assert caps["core_limit"] in ("green_context", None)
    assert caps["task_update"] is False
    assert isinstance(caps["sm_count"], int) and caps["sm_count"] > 0
    assert ngr.max_core_num("cuda")[0] == caps["sm_count"]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
@torch.inference_mode()
def test_limit_core_num_on_cuda_gives_eager_results(backend: AcceleratorBackend) -> None:
    sms = ngr.max_core_num("cuda")[0]
    limit = max(8, (sms // 2) // 8 * 8)  # Hopper partitions SMs in groups of 8
    a = torch.randn(512, 512, device="cuda")
    expected = (a @ a).tanh()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no green contexts on this torch/driver: one warning
        with ngr.limit_core_num(limit, 0, device="cuda"):
            got = (a @ a).tanh()
            assert ngr.current_core_limit() == ("cuda", limit, 0)
    torch.cuda.synchronize()
    torch.testing.assert_close(got, expected)
    with pytest.raises(PolicyError, match=f"op_aicore_num={sms + 1}.*{sms}"):
        ngr.limit_core_num(sms + 1, 0, device="cuda")



@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
def test_debug_dump_writes_the_captured_graph(
    backend: AcceleratorBackend, side_stream: torch.cuda.Stream, tmp_path: pathlib.Path
) -> None:
    x = torch.ones(16, device="cuda")
    graph = AcceleratorGraph(backend, torch.device("cuda"), use_accelerator_graph=False)
    graph.enable_debug_mode()
    with pytest.raises(CaptureError, match="never captured"):
        graph.debug_dump(str(tmp_path / "g.dot"))
    _capture(graph, side_stream, lambda: x * 3 + 1)
    graph.debug_dump(str(tmp_path / "g.dot"))
    assert (tmp_path / "g.dot").read_text().startswith("digraph")
