"""CPU memory pools: the liveness planner, sharing between graphs, claims and pool_bytes."""

from __future__ import annotations

from collections.abc import Callable

import npugraph_runtime as ngr
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st


def _capture_into(model: torch.nn.Module, x: torch.Tensor, pool: object) -> tuple[object, torch.Tensor]:
    g = ngr.Graph("cpu")
    with torch.no_grad(), ngr.graph(g, pool=pool):
        y = model(x)
    return g, y


def _in_pool(t: torch.Tensor, pool: object) -> bool:
    from npugraph_runtime.devices.cpu_pool import cpu_pool

    ptr = t.data_ptr()
    return any(
        b.storage.data_ptr() <= ptr < b.storage.data_ptr() + b.nbytes
        for b in cpu_pool(pool).blocks  # type: ignore[arg-type]
    )


def test_five_batch_sizes_in_one_pool_hold_less_than_private_pools(
    make_mlp: Callable[..., torch.nn.Module],
) -> None:
    model = make_mlp((64, 256, 256, 256, 16))
    sizes = (16, 8, 4, 2, 1)
    shared = ngr.graph_pool_handle("cpu")
    graphs = []
    for n in sizes:
        x = torch.randn(n, 64)
        g, y = _capture_into(model, x, shared)
        graphs.append((g, x, y))
    private = []
    for n in sizes:
        g, y = _capture_into(model, torch.randn(n, 64), None)
        private.append(g)
    shared_bytes = ngr.pool_bytes(shared)
    private_bytes = sum(ngr.pool_bytes(g.pool()) for g in private)
    assert 0 < shared_bytes < 0.7 * private_bytes
    for g, x, _ in graphs:  # replay all, then check all: a shared buffer must not leak into outputs
        x.copy_(torch.randn_like(x))
        g.replay()
    for _, x, y in graphs:
        with torch.no_grad():
            torch.testing.assert_close(y, model(x), rtol=0, atol=0)


def test_intermediates_with_disjoint_lifetimes_share_a_buffer() -> None:
    x = torch.randn(1024)

    def chain(t: torch.Tensor) -> torch.Tensor:
        for _ in range(8):
            t = (t * 1.01).sin()
        return t

    g = ngr.Graph("cpu")
    with ngr.graph(g):
        y = chain(x)
    intermediates = 15 * x.nbytes  # 16 results, the last is the output
    assert ngr.pool_bytes(g.pool()) <= 2 * x.nbytes < intermediates
    x.copy_(torch.randn(1024))
    g.replay()
    torch.testing.assert_close(y, chain(x), rtol=0, atol=0)


def test_outputs_are_never_in_pool_buffers(small_mlp: torch.nn.Module) -> None:
    pool = ngr.graph_pool_handle("cpu")
    x = torch.randn(8, 32)
    model = small_mlp
    g1, y1 = _capture_into(model, x, pool)
    g2, y2 = _capture_into(model, x * 2, pool)
    assert not _in_pool(y1, pool) and not _in_pool(y2, pool)
    g1.replay()
    expected = y1.clone()
    g2.replay()  # shares g1's buffers: must not touch g1's output
    torch.testing.assert_close(y1, expected, rtol=0, atol=0)


def test_tensor_kept_by_the_user_is_live_and_not_pooled() -> None:
    x = torch.randn(64)
    kept: list[torch.Tensor] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        h = t.exp()
        kept.append(h)
        return h.sin()

    g = ngr.Graph("cpu")
    with ngr.graph(g):
        y = fn(x)
    assert not _in_pool(kept[0], g.pool())
    x.copy_(torch.randn(64))
    g.replay()
    torch.testing.assert_close(kept[0], x.exp(), rtol=0, atol=0)
    torch.testing.assert_close(y, x.exp().sin(), rtol=0, atol=0)


def test_reset_releases_the_graphs_claims(small_mlp: torch.nn.Module) -> None:
    pool = ngr.graph_pool_handle("cpu")
    x = torch.randn(16, 32)
    model = small_mlp
    g1, _ = _capture_into(model, x, pool)
    g2, _ = _capture_into(model, x[:4], pool)
    held = ngr.pool_bytes(pool)
    assert held > 0
    g1.reset()
    assert 0 < ngr.pool_bytes(pool) <= held
    g2.reset()
    assert ngr.pool_bytes(pool) == 0


def test_new_pool_holds_nothing_and_graph_has_a_private_pool() -> None:
    assert ngr.pool_bytes(ngr.graph_pool_handle("cpu")) == 0
    a, b = ngr.Graph("cpu"), ngr.Graph("cpu")
    assert a.pool() != b.pool()


def test_pool_of_another_device_is_refused() -> None:
    from npugraph_runtime.graphs import as_pool_handle

    foreign = ngr.PoolHandle(torch.device("cuda", 0), (0, 1))
    with pytest.raises(ngr.DeviceError, match="cannot be used by a graph of cpu"):
        as_pool_handle(foreign, "cpu")
    assert as_pool_handle(7, "cpu") == ngr.PoolHandle(torch.device("cpu"), 7)
    with pytest.raises(ngr.PolicyError, match="not a pool of cpu"):
        as_pool_handle("shared", "cpu")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 5000), st.integers(0, 30), st.integers(0, 10)),
        min_size=1,
        max_size=25,
    ),
    st.integers(0, 2),
)
def test_planner_never_overlaps_items_alive_at_the_same_time(
    raw: list[tuple[int, int, int]], earlier_graphs: int
) -> None:
    from npugraph_runtime.devices.cpu_pool import CpuPool, Lifetime

    pool = CpuPool(0)
    for g in range(earlier_graphs):  # blocks left by other graphs of the pool
        pool.plan([Lifetime(1000 * (g + 1), 0, 1)])
    items = [Lifetime(n, first, first + span) for n, first, span in raw]
    placed = pool.plan(items)
    for i, (a, pa) in enumerate(zip(items, placed, strict=True)):
        assert pa.offset + a.nbytes <= pa.block.nbytes
        assert pa.offset % 64 == 0
        for b, pb in list(zip(items, placed, strict=True))[i + 1 :]:
            same_time = a.first <= b.last and b.first <= a.last
            same_bytes = (
                pa.block is pb.block
                and pa.offset < pb.offset + b.nbytes
                and pb.offset < pa.offset + a.nbytes
            )
            assert not (same_time and same_bytes)


def test_dropped_graph_gives_its_blocks_back(small_mlp: torch.nn.Module) -> None:
    pool = ngr.graph_pool_handle("cpu")
    x = torch.randn(16, 32)
    big, _ = _capture_into(small_mlp, x, pool)
    keeper, _ = _capture_into(lambda t: t + 1, x, pool)  # no intermediates, keeps the pool alive
    assert ngr.pool_bytes(pool) > 0
    del big
    assert ngr.pool_bytes(pool) == 0
    keeper.replay()
