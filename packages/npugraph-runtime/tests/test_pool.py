"""CPU memory pools: the liveness planner, sharing between graphs, claims and pool_bytes."""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from typing import Any

import npugraph_runtime as ngr
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

AssertSame = Callable[[Any, Any], None]


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


def _graph_a(x: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ x.t()) * 3
    return h.exp().log1p().sum(0) + 1


def _graph_b(y: torch.Tensor) -> torch.Tensor:
    z = (y * 7).sin()
    return (z.cumsum(0) * z).tanh()


def test_a_graphs_output_survives_another_graph_of_its_pool(assert_same: AssertSame) -> None:
    pool = ngr.graph_pool_handle("cpu")
    xa, xb = torch.randn(16, 16), torch.randn(16, 16)
    ga, gb = ngr.Graph("cpu"), ngr.Graph("cpu")
    with ngr.graph(ga, pool=pool):
        out_a = _graph_a(xa)
    with ngr.graph(gb, pool=pool):
        out_b = _graph_b(xb)
    assert ngr.pool_bytes(pool) > 0
    for _ in range(4):
        xa.copy_(torch.randn(16, 16))
        xb.copy_(torch.randn(16, 16))
        ga.replay()
        kept = out_a.clone()
        gb.replay()
        assert torch.equal(out_a, kept)
        assert_same(out_a, _graph_a(xa))
        assert_same(out_b, _graph_b(xb))


def _shaped(x: torch.Tensor) -> torch.Tensor:
    return ((x * 2).softmax(-1) @ x.t()).relu().sum(-1)


def test_many_shapes_in_one_pool_replayed_in_random_order_and_after_resets(assert_same: AssertSame) -> None:
    rng = random.Random(0)
    pool = ngr.graph_pool_handle("cpu")
    graphs = []
    for n in (3, 7, 16, 5, 32, 1):
        x = torch.randn(n, n + 1)
        g = ngr.Graph("cpu")
        with ngr.graph(g, pool=pool):
            out = _shaped(x)
        graphs.append((g, x, out))

    def replay_some(indices: list[int], times: int) -> None:
        for _ in range(times):
            g, x, out = graphs[rng.choice(indices)]
            x.copy_(torch.randn_like(x))
            g.replay()
            assert_same(out, _shaped(x))

    replay_some(list(range(6)), 30)
    graphs[1][0].reset()
    graphs[4][0].reset()
    gc.collect()
    replay_some([0, 2, 3, 5], 15)
    for n in (9, 40):  # new captures reuse the pool the resets freed
        x = torch.randn(n, n + 1)
        g = ngr.Graph("cpu")
        with ngr.graph(g, pool=pool):
            out = _shaped(x)
        graphs.append((g, x, out))
    replay_some([0, 2, 3, 5, 6, 7], 30)


def test_a_graph_replayed_inside_another_capture_of_its_pool(assert_same: AssertSame) -> None:
    """The outer capture records the inner graph's replay, which uses the inner graph's blocks
    of the shared pool: the outer graph's own intermediates must not be placed over them."""
    pool = ngr.graph_pool_handle("cpu")
    inner = ngr.make_graphed_callable(lambda x: (x.sin() * 3).exp().sum(0), [torch.randn(8, 8)],
                                      pool=pool)

    def outer_fn(y: torch.Tensor) -> torch.Tensor:
        return ((y.cos() * 5) + 1) * inner(y * 2) + y.cos()

    outer = ngr.make_graphed_callable(outer_fn, [torch.randn(8, 8)], pool=pool)
    for _ in range(4):
        y = torch.randn(8, 8)
        assert_same(outer(y), outer_fn(y))


def test_an_output_of_one_key_survives_calls_of_other_keys_sharing_the_pool(assert_same: AssertSame) -> None:
    """CPU graphs never place outputs in the pool: a key's static output changes only when that
    key replays again."""
    fn = ngr.make_graphed_callable(_shaped, [torch.randn(3, 4)])
    x3 = torch.randn(3, 4)
    fn(x3)
    out3 = fn(x3)
    kept = out3.clone()
    for rows in (5, 7, 5, 9):
        x = torch.randn(rows, 4)
        assert_same(fn(x), _shaped(x))
        assert torch.equal(out3, kept)
    assert fn.num_captures == 4
