"""The emulated CPU device graph: capture, replay, side effects, unsafe ops, bad usage."""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Callable
from typing import Any

import npugraph_runtime as ngr
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from npugraph_runtime.devices import backend_for
from npugraph_runtime.errors import CaptureError

# replays against eager at rtol=0 (replay kernels chosen by a bitwise check): nox -s ci reruns
# them under a second kernel variant
pytestmark = pytest.mark.numerics
AssertSame = Callable[[Any, Any], None]


def capture(fn: Callable[..., Any], *args: Any, **graph_kwargs: Any) -> tuple[Any, Any]:
    g = ngr.Graph("cpu")
    with torch.no_grad(), ngr.graph(g, **graph_kwargs):
        out = fn(*args)
    return g, out


def capture_on(device: str, fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """Capture on ``device`` after one eager warm-up run (CUDA initialises its libraries lazily)."""
    with torch.no_grad():
        fn(*args)
        g = ngr.Graph(device)
        with ngr.graph(g):
            out = fn(*args)
    return g, out


def test_mlp_replay_matches_eager_after_new_inputs(small_mlp: torch.nn.Module, device: str) -> None:
    model = small_mlp.to(device)
    x = torch.randn(4, 32, device=device)
    g, y = capture_on(device, model, x)
    for _ in range(3):
        x.copy_(torch.randn(4, 32, device=device))
        g.replay()
        with torch.no_grad():
            torch.testing.assert_close(y, model(x))


def test_outputs_keep_their_address_across_replays(small_mlp: torch.nn.Module, device: str) -> None:
    model = small_mlp.to(device)
    x = torch.randn(2, 32, device=device)
    g, y = capture_on(device, model, x)
    ptr = y.data_ptr()
    for _ in range(3):
        x.normal_()
        g.replay()
        assert y.data_ptr() == ptr
    with torch.no_grad():
        torch.testing.assert_close(y, model(x))


def test_capture_with_grad_enabled_replays_like_eager(small_mlp: torch.nn.Module) -> None:
    x = torch.randn(3, 32)
    g = ngr.Graph("cpu")
    with ngr.graph(g):  # parameters require grad; replay must still write in place
        y = small_mlp(x)
    x.copy_(torch.randn(3, 32))
    g.replay()
    torch.testing.assert_close(y.detach(), small_mlp(x).detach(), rtol=0, atol=0)
    assert torch.is_grad_enabled()


def test_replay_reuses_recorded_views_and_multi_output_ops() -> None:
    x = torch.randn(4, 6, 8)

    def fn(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        v = t.transpose(0, 1)[1:5].reshape(4, 32)
        values, indices = v.max(dim=1)
        out, _, _ = torch.ops.aten.native_layer_norm.default(v, [32], None, None, 1e-5)
        return values * 2, indices, out.cumsum(0)

    g, outs = capture(fn, x)
    x.copy_(torch.randn(4, 6, 8))
    g.replay()
    for got, want in zip(outs, fn(x), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_in_place_side_effect_applies_once_per_replay_not_at_capture(device: str) -> None:
    counter = torch.zeros(3, device=device)
    step = torch.tensor([1.0, 2.0, 3.0], device=device)
    g = ngr.Graph(device)
    with ngr.graph(g):
        counter.add_(step)
    torch.testing.assert_close(counter, torch.zeros(3, device=device))
    g.replay()
    g.replay()
    torch.testing.assert_close(counter, 2 * step)


def test_static_cache_update_in_place_matches_eager() -> None:
    cache = torch.zeros(8, 4)
    pos = torch.tensor([0])
    new = torch.randn(1, 4)

    def write_and_sum() -> torch.Tensor:
        cache.index_copy_(0, pos, new)
        return cache.sum(0) * 2

    g, out = capture(write_and_sum)
    assert torch.count_nonzero(cache) == 0  # the capture wrote nothing
    ref = torch.zeros(8, 4)
    for i in range(4):
        pos.fill_(i)
        new.normal_()
        g.replay()
        ref.index_copy_(0, pos, new)
        torch.testing.assert_close(cache, ref, rtol=0, atol=0)
        torch.testing.assert_close(out, ref.sum(0) * 2, rtol=0, atol=0)


def test_intermediate_written_in_place_is_recomputed_each_replay() -> None:
    x = torch.randn(5)

    def fn(t: torch.Tensor) -> torch.Tensor:
        buf = torch.zeros(5)
        buf.add_(t).mul_(3)
        buf[1:3] = 7.0
        return buf.exp()

    g, out = capture(fn, x)
    for _ in range(2):
        x.normal_()
        g.replay()
        torch.testing.assert_close(out, fn(x), rtol=0, atol=0)


def test_recorded_ops_counts_replayed_ops_not_views() -> None:
    x = torch.randn(4, 4)
    g, _ = capture(lambda t: (t.t() + 1)[1:].relu(), x)
    assert g.recorded_ops() == 2  # add, relu; t() and the slice are free


def test_op_whose_result_nobody_reads_is_not_replayed() -> None:
    x = torch.randn(4)

    def fn(t: torch.Tensor) -> torch.Tensor:
        t.exp()  # computed and thrown away
        return t.sin()

    g, y = capture(fn, x)
    assert g.recorded_ops() == 1
    x.copy_(torch.randn(4))
    g.replay()
    torch.testing.assert_close(y, x.sin(), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("fn", "op_name"),
    [
        (lambda t: t * t.sum().item(), "aten._local_scalar_dense.default"),
        (lambda t: t.nonzero(), "aten.nonzero.default"),
        (lambda t: t + torch.rand_like(t), "aten.rand_like.default"),
    ],
    ids=["item", "nonzero", "rand_like"],
)
def test_unsafe_op_is_refused_with_its_name(fn: Callable[[torch.Tensor], Any], op_name: str) -> None:
    x = torch.randn(4)
    g = ngr.Graph("cpu")
    with pytest.raises(ngr.CaptureError, match=op_name.replace(".", r"\.")), ngr.graph(g):
        fn(x)
    with pytest.raises(ngr.CaptureError, match="no capture"):
        g.replay()


def test_thread_local_mode_refuses_unsafe_ops_too() -> None:
    x = torch.randn(4)
    g = ngr.Graph("cpu")
    with pytest.raises(ngr.CaptureError, match="thread_local"), ngr.graph(
        g, capture_error_mode="thread_local"
    ):
        x.sum().item()


def test_refused_capture_restores_inputs_and_allows_a_new_capture() -> None:
    state = torch.ones(3)
    g = ngr.Graph("cpu")
    with pytest.raises(ngr.CaptureError), ngr.graph(g):
        state.mul_(5)
        state.sum().item()
    torch.testing.assert_close(state, torch.ones(3))
    with ngr.graph(g):
        state.mul_(2)
    g.replay()
    torch.testing.assert_close(state, torch.full((3,), 2.0))


def test_relaxed_mode_warns_once_and_replays_captured_values() -> None:
    x = torch.randn(6)
    g = ngr.Graph("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ngr.graph(g, capture_error_mode="relaxed"):
            noise = torch.rand_like(x)
            out = x + noise
            noise2 = torch.randn(6)
            out2 = out * noise2
    relaxed = [w for w in caught if "relaxed" in str(w.message)]
    assert len(relaxed) == 1
    assert "aten.rand_like.default" in str(relaxed[0].message)
    captured_noise, captured_noise2 = noise.clone(), noise2.clone()
    x.copy_(torch.randn(6))
    g.replay()
    torch.testing.assert_close(noise, captured_noise, rtol=0, atol=0)
    torch.testing.assert_close(out, x + captured_noise, rtol=0, atol=0)
    torch.testing.assert_close(out2, (x + captured_noise) * captured_noise2, rtol=0, atol=0)


def test_tensor_of_another_device_is_a_device_error() -> None:
    x = torch.randn(3)
    meta = torch.empty(3, device="meta")
    g = ngr.Graph("cpu")
    with pytest.raises(ngr.DeviceError, match="meta"), ngr.graph(g):
        torch.add(x, meta)
    with pytest.raises(ngr.CaptureError):
        g.replay()


def test_cross_device_copy_is_refused() -> None:
    x = torch.randn(3)
    g = ngr.Graph("cpu")
    with pytest.raises(ngr.CaptureError, match=r"aten\._to_copy\.default.*between devices"), ngr.graph(g):
        x.to("meta")


def test_replay_before_capture_is_a_capture_error() -> None:
    with pytest.raises(ngr.CaptureError, match="capture it first"):
        ngr.Graph("cpu").replay()


def test_capture_inside_capture_is_a_capture_error() -> None:
    x = torch.randn(3)
    before = x.clone()
    outer, inner = ngr.Graph("cpu"), ngr.Graph("cpu")
    with pytest.raises(ngr.CaptureError, match="cannot nest"), ngr.graph(outer):
        x.add_(1)
        with ngr.graph(inner):
            pass
    torch.testing.assert_close(x, before, rtol=0, atol=0)  # the aborted capture wrote nothing
    with pytest.raises(ngr.CaptureError):
        outer.replay()


def test_replay_while_capturing_is_a_capture_error() -> None:
    g = ngr.Graph("cpu")
    with pytest.raises(ngr.CaptureError, match="is capturing"), ngr.graph(g):
        g.replay()


def test_capture_end_without_begin_is_a_capture_error() -> None:
    with pytest.raises(ngr.CaptureError, match="without capture_begin"):
        ngr.Graph("cpu").capture_end()


def test_reset_while_capturing_is_a_capture_error_and_capture_goes_on() -> None:
    x = torch.randn(3)
    g = ngr.Graph("cpu")
    g.capture_begin()
    y = x * 2
    with pytest.raises(ngr.CaptureError, match="while the graph is capturing"):
        g.reset()
    g.capture_end()
    x.copy_(torch.randn(3))
    g.replay()
    torch.testing.assert_close(y, x * 2)


def test_reset_drops_the_capture() -> None:
    x = torch.randn(3)
    g, _ = capture(lambda t: t + 1, x)
    g.reset()
    with pytest.raises(ngr.CaptureError):
        g.replay()


def test_unknown_capture_error_mode_is_a_policy_error() -> None:
    with pytest.raises(ngr.PolicyError, match=r"capture_error_mode='loose'.*relaxed"):
        ngr.Graph("cpu").capture_begin(capture_error_mode="loose")


def test_unknown_device_names_the_supported_ones() -> None:
    with pytest.raises(ngr.DeviceError, match=r"'tpu'.*'cpu', 'cuda', 'npu'"):
        ngr.Graph("tpu")
    with pytest.raises(ngr.DeviceError, match="'cpu', 'cuda', 'npu'"):
        backend_for("not-a-device")


def test_other_threads_ops_are_not_recorded() -> None:
    x = torch.randn(3)
    side = torch.zeros(3)
    g = ngr.Graph("cpu")
    with ngr.graph(g):
        worker = threading.Thread(target=lambda: side.add_(1))
        worker.start()
        worker.join()
        y = x + 1
    torch.testing.assert_close(side, torch.ones(3))  # ran eagerly, once
    g.replay()
    torch.testing.assert_close(side, torch.ones(3))
    torch.testing.assert_close(y, x + 1)


def test_collective_result_is_waited_for_and_copied() -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD.group_name
        x = torch.randn(4)

        def fn(t: torch.Tensor) -> torch.Tensor:
            r = torch.ops._c10d_functional.all_reduce(t * 2, "sum", group)
            return torch.ops._c10d_functional.wait_tensor(r) + 1

        g, out = capture(fn, x)
        x.copy_(torch.randn(4))
        g.replay()
        torch.testing.assert_close(out, x * 2 + 1)
    finally:
        dist.destroy_process_group()


def test_capture_in_inference_mode_replays_outside_it() -> None:
    x = torch.randn(4)
    g = ngr.Graph("cpu")
    with torch.inference_mode(), ngr.graph(g):
        y = (x * 2).sin()
    x.copy_(torch.randn(4))
    g.replay()
    torch.testing.assert_close(y, (x * 2).sin(), rtol=0, atol=0)


def test_intermediate_grown_by_an_out_op_replays() -> None:
    a, b = torch.randn(3, 4), torch.randn(2, 4)

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(0)
        torch.cat([x, y], out=buf)  # resizes buf's storage after it was recorded
        return buf * 2

    g, out = capture(fn, a, b)
    a.copy_(torch.randn(3, 4))
    b.copy_(torch.randn(2, 4))
    g.replay()
    torch.testing.assert_close(out, fn(a, b), rtol=0, atol=0)


_UNARY = (torch.tanh, torch.sin, torch.relu, torch.neg, torch.sigmoid)
_BINARY = (torch.add, torch.mul, torch.sub, torch.maximum)


def _run_program(program: list[tuple[int, int, int]], x: torch.Tensor, y: torch.Tensor,
                 state: torch.Tensor) -> list[torch.Tensor]:
    """A random straight-line program over (4, 6) tensors: unary and binary ops, shape-preserving
    views, reductions broadcast back, cat + slice, matmuls, in-place updates of intermediates and of
    ``state``; values it never uses are dead code."""
    values = [x, y]
    for op, i, j in program:
        a, b = values[i % len(values)], values[j % len(values)]
        kind = op % 9
        if kind == 0:
            v = _UNARY[op % len(_UNARY)](a)
        elif kind == 1:
            v = _BINARY[op % len(_BINARY)](a, b)
        elif kind == 2:
            v = a.view(6, 4).t().t().view(4, 6) * 1.5
        elif kind == 3:
            v = a.sum(0, keepdim=True).expand(4, 6) + b
        elif kind == 4:
            v = torch.cat([a, b], 0)[2:6]
        elif kind == 5:
            v = (a @ b.t()) @ b / 8
        elif kind == 6 and a is not x and a is not y:
            v = a.add_(b)  # in place on an intermediate
        elif kind == 7:
            state.mul_(0.5).add_(a[:1])
            v = state.expand(4, 6) + b
        else:
            v = a.unsqueeze(0).squeeze(0).clamp(-1, 1)
        values.append(v)
    return values[-2:] + values[len(values) // 2 : len(values) // 2 + 1]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 80), st.integers(0, 40), st.integers(0, 40)),
                min_size=1, max_size=14))
def test_random_programs_replay_like_eager(program: list[tuple[int, int, int]]) -> None:
    x, y, state = torch.randn(4, 6), torch.randn(4, 6), torch.randn(1, 6)
    state_before = state.clone()
    g, outs = capture(_run_program, program, x, y, state)
    torch.testing.assert_close(state, state_before, rtol=0, atol=0)  # capture applied nothing
    for _ in range(2):
        x.copy_(torch.randn(4, 6))
        y.copy_(torch.randn(4, 6))
        eager_state = state.clone()
        expected = _run_program(program, x.clone(), y.clone(), eager_state)
        g.replay()
        for got, want in zip(outs, expected, strict=True):
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(state, eager_state)


def test_custom_op_without_result_is_reissued() -> None:
    lib = torch.library.Library("npugraph_cpu_test", "FRAGMENT")
    lib.define("bump(Tensor t) -> ()")  # a schema that does not declare its write

    def bump(t: torch.Tensor) -> None:
        t.add_(1)

    lib.impl("bump", bump, "CPU")
    counter = torch.zeros(2)
    g = ngr.Graph("cpu")
    with ngr.graph(g):
        torch.ops.npugraph_cpu_test.bump(counter)
    g.replay()
    g.replay()
    assert counter.tolist() == [2.0, 2.0]  # never at capture, once per replay


def test_sparse_tensor_is_a_capture_error() -> None:
    sparse = torch.eye(3).to_sparse()
    g = ngr.Graph("cpu")
    with pytest.raises(ngr.CaptureError, match="sparse"), ngr.graph(g):
        sparse * 2


def test_capture_end_from_another_thread_is_refused() -> None:
    x = torch.randn(3)
    g = ngr.Graph("cpu")
    g.capture_begin()
    y = x + 1
    errors: list[BaseException] = []

    def end_elsewhere() -> None:
        try:
            g.capture_end()
        except ngr.CaptureError as e:
            errors.append(e)

    worker = threading.Thread(target=end_elsewhere)
    worker.start()
    worker.join()
    assert len(errors) == 1 and "another thread" in str(errors[0])
    g.capture_end()  # still capturing here: ends normally
    g.replay()
    torch.testing.assert_close(y, x + 1)


def test_hand_capture_replays_after_its_locals_died_and_in_another_thread(assert_same: AssertSame) -> None:
    def build() -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        w = torch.randn(8, 8)
        x = torch.randn(4, 8)
        g = ngr.Graph("cpu")
        with ngr.graph(g):
            out = (x @ w).relu() + w.sum()
        return g, x, out, w.clone()

    g, x, out, w = build()
    gc.collect()
    for _ in range(2):
        x.copy_(torch.randn(4, 8))
        g.replay()
        assert_same(out, (x @ w).relu() + w.sum())
    results: list[bool] = []

    def work() -> None:
        x.copy_(torch.randn(4, 8))
        g.replay()
        results.append(torch.equal(out, (x @ w).relu() + w.sum()))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert results == [True]


def test_boolean_mask_indexing_is_refused() -> None:
    x, g = torch.randn(8), ngr.Graph("cpu")
    with pytest.raises(CaptureError, match="output shape that depends on the data"), ngr.graph(g):
        _ = x[x > 0] * 2


@pytest.mark.parametrize(
    ("fn", "what"),
    [
        (lambda x: x * x.tolist()[0], r"Tensor\.tolist"),
        (lambda x: x * float(x.numpy()[0]), r"Tensor\.numpy"),
        (lambda x: x * len(repr(x[0])), r"Tensor\.__repr__"),
        (lambda x: x + torch.tensor([x[0], x[1], 0, 0, 0, 0]), r"torch\.tensor\(\) of a list"),
    ],
    ids=["tolist", "numpy", "repr", "tensor_of_elements"],
)
def test_host_reads_that_bypass_dispatch_are_refused(fn: Callable[[torch.Tensor], Any], what: str) -> None:
    """On the CPU these read values without an ATen op: replays would silently repeat them."""
    x = torch.randn(6)
    kept = x.clone()
    g = ngr.Graph("cpu")
    with pytest.raises(CaptureError, match=what + ".*reads tensor values on the host"), ngr.graph(g):
        fn(x)
    assert torch.equal(x, kept)
    with pytest.raises(CaptureError, match="holds no capture"):
        g.replay()


def test_host_read_in_relaxed_mode_warns_and_repeats_the_captured_value(assert_same: AssertSame) -> None:
    x = torch.randn(6)
    first = x.tolist()[0]
    g = ngr.Graph("cpu")
    with pytest.warns(UserWarning, match=r"Tensor\.tolist"), ngr.graph(g, capture_error_mode="relaxed"):
        out = x * x.tolist()[0]
    x.copy_(torch.randn(6))
    g.replay()
    assert_same(out, x * first)


def _indexed_writes(kv: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
                    rows: torch.Tensor) -> torch.Tensor:
    kv.index_put_((slots, pos), rows)  # slot 2, position 1 twice: a duplicate index
    kv.index_put_((slots, pos), rows, accumulate=True)
    torch.ops.aten.index_put_(kv, [None, pos], rows[None].expand(4, 3, 6).clone())
    kv[1:3].index_put_((kv.new_tensor([True, False], dtype=torch.bool),), rows[:1, None, :])
    kv.index_put_((slots % 2,), kv[slots % 2] * 0.5)  # indices made inside the capture
    out = kv.sum(0)
    kv.mul_(2.0)  # the whole buffer, after rows of it were written
    kv.index_put_((slots, pos), -rows)  # rows, after the whole buffer was kept
    return out


def test_a_capture_undoes_its_indexed_writes_exactly() -> None:
    """A capture whose run is not the call's leaves a pre-existing buffer as it found it, bit
    for bit, whichever way it was written; the replays then write it as eager does."""
    kv = torch.randn(4, 8, 6)
    before = kv.clone()
    slots, pos, rows = torch.tensor([2, 0, 2]), torch.tensor([1, 5, 1]), torch.randn(3, 6)
    g, out = capture(_indexed_writes, kv, slots, pos, rows)
    assert torch.equal(kv, before)
    expected_kv = kv.clone()
    for _ in range(3):
        rows.copy_(torch.randn(3, 6))
        expected = _indexed_writes(expected_kv, slots, pos, rows)
        g.replay()
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        assert torch.equal(kv, expected_kv)


def test_an_indexed_write_keeps_only_the_elements_it_overwrites() -> None:
    """Undoing a few rows written into a large buffer copies those rows, not the buffer."""
    from npugraph_runtime.devices.cpu_undo import UndoLog

    kv = torch.zeros(64, 256, 32)
    slots, pos, rows = torch.tensor([3, 9]), torch.tensor([7, 8]), torch.ones(2, 32)
    log = UndoLog()
    log.before_write(kv, torch.ops.aten.index_put_.default, (kv, [slots, pos], rows))
    assert log.kept_bytes() == rows.nbytes
    kv.index_put_((slots, pos), rows)
    log.before_write(kv, torch.ops.aten.mul_.Tensor, (kv, 2.0))
    assert log.kept_bytes() == rows.nbytes + kv.untyped_storage().nbytes()
    kv.mul_(2.0)
    log.undo()
    assert not kv.any()
    # elements of an expanded tensor share memory: such a write (refused by torch) keeps it all
    wide = torch.zeros(1, 32).expand(4, 32)
    log = UndoLog()
    log.before_write(wide, torch.ops.aten.index_put_.default, (wide, [slots], rows))
    assert log.kept_bytes() == wide.untyped_storage().nbytes()
