"""GraphedCallable on the CPU device graph: keys, recaptures and their reasons, fallbacks,
input and output policies (aliasing, clone_input / clone_output, in-place writes, nested
results), calls that need autograd, threads. Every result is compared with eager."""

from __future__ import annotations

import gc
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import npugraph_runtime as ngr
import pytest
import torch
import torch.nn.functional as F
from npugraph_runtime._compat import npugraph_ex_counters
from npugraph_runtime.errors import CaptureError, PolicyError
from npugraph_runtime.spec import CapturePolicy, InputSpec, OutputSpec, SlotKind

AssertSame = Callable[[Any, Any], None]


def counters() -> dict[str, int]:
    return dict(npugraph_ex_counters())


def linear_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.relu(F.linear(x, w, b)) * 2,)


@pytest.fixture
def layer() -> torch.nn.Linear:
    return torch.nn.Linear(16, 8).eval()


def test_each_new_shape_is_a_new_key_captured_once(layer: torch.nn.Linear) -> None:
    fn = ngr.make_graphed_callable(linear_relu, (torch.randn(4, 16), layer.weight, layer.bias),
                                   static_argnums=(1, 2), name="shapes")
    with torch.no_grad():
        for rows in (4, 4, 2, 4, 2, 7, 7):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(fn(x, layer.weight, layer.bias), linear_relu(x, layer.weight, layer.bias))
    assert [e.reason for e in fn.events] == ["new_key"] * 3
    f32 = (torch.float32, torch.device("cpu"))  # hand-written keys hold each tensor's dtype and device
    assert [e.key for e in fn.events] == [(2, 4, 16, *f32), (2, 2, 16, *f32), (2, 7, 16, *f32)]
    assert fn.num_captures == 3 and set(fn.graphs) == {(2, 4, 16, *f32), (2, 2, 16, *f32), (2, 7, 16, *f32)}
    assert counters()["capture_due_to_new_key_shapes"] == 3
    assert counters()["captured_shapes"] == 3


def test_symbolic_int_selects_the_key() -> None:
    def head(x: torch.Tensor, n: int) -> torch.Tensor:
        return x[:n].sin()

    spec = InputSpec((SlotKind.USER, SlotKind.SYMBOLIC), ((), None))
    fn = ngr.GraphedCallable(head, spec, CapturePolicy(name="symbolic"))
    x = torch.randn(8, 4)
    for n in (3, 5, 3, 5, 3):
        torch.testing.assert_close(fn(x, n), head(x, n))
    assert [e.key for e in fn.events] == [(3, int), (5, int)]  # value, then type


def test_no_keyed_input_gives_the_constant_key(layer: torch.nn.Linear) -> None:
    spec = InputSpec((SlotKind.USER, SlotKind.STATIC, SlotKind.STATIC), ((), (), ()))
    fn = ngr.GraphedCallable(linear_relu, spec, CapturePolicy())
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 16)
            torch.testing.assert_close(fn(x, layer.weight, layer.bias), linear_relu(x, layer.weight, layer.bias))
    assert fn.events == [ngr.CaptureEvent((), "new_key")]
    assert fn.name.startswith("graph_")


def kv_step(x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(0, pos, x)
    return cache.sum(0) * 1.5


def test_new_kv_cache_tensor_recaptures_and_leaves_the_old_cache_alone() -> None:
    cache_a, cache_b = torch.zeros(6, 4), torch.zeros(6, 4)
    eager_a, eager_b = cache_a.clone(), cache_b.clone()
    fn = ngr.make_graphed_callable(kv_step, (torch.randn(1, 4), torch.tensor([0]), cache_a),
                                   mutated_argnums=(2,), name="kv")
    for step in range(3):
        x, pos = torch.randn(1, 4), torch.tensor([step])
        torch.testing.assert_close(fn(x, pos, cache_a), kv_step(x, pos, eager_a))
    torch.testing.assert_close(cache_a, eager_a)
    kept = cache_a.clone()
    for step in range(3):
        x, pos = torch.randn(1, 4), torch.tensor([step])
        torch.testing.assert_close(fn(x, pos, cache_b), kv_step(x, pos, eager_b))
    torch.testing.assert_close(cache_b, eager_b)
    assert torch.equal(cache_a, kept)
    assert [e.reason for e in fn.events] == ["new_key", "mutated_input_change"]
    assert fn.num_captures == 2  # cache_a is still alive: its capture is kept beside
    assert counters()["recapture_due_to_mutated_input_change_kv"] == 1


def test_force_recapture_recaptures_every_call_after_the_first(layer: torch.nn.Linear) -> None:
    fn = ngr.make_graphed_callable(linear_relu, (torch.randn(4, 16), layer.weight, layer.bias),
                                   static_argnums=(1, 2), force_recapture=True, name="forced")
    with torch.no_grad():
        for call in range(4):
            x = torch.randn(4, 16)
            torch.testing.assert_close(fn(x, layer.weight, layer.bias), linear_relu(x, layer.weight, layer.bias))
            assert counters().get("recapture_due_to_force_recapture_forced", 0) == call
    assert [e.reason for e in fn.events] == ["new_key"] + ["force_recapture"] * 3
    assert fn.num_captures == 1


def test_a_recapture_is_not_warmed_up_again_and_returns_the_fresh_capture(layer: torch.nn.Linear) -> None:
    runs = []

    def counted(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
        runs.append(1)  # once per eager run or capture (replays do not run Python)
        return linear_relu(x, w, b)

    fn = ngr.make_graphed_callable(counted, (torch.randn(4, 16), layer.weight, layer.bias),
                                   static_argnums=(1, 2), force_recapture=True)
    with torch.no_grad():
        x = torch.randn(4, 16)
        first = fn(x, layer.weight, layer.bias)
        assert len(runs) == 2  # warmup (the call's result) + capture
        for call in range(3):
            x = torch.randn(4, 16)
            out = fn(x, layer.weight, layer.bias)
            torch.testing.assert_close(out, linear_relu(x, layer.weight, layer.bias))
            assert len(runs) == 3 + call  # capture only; the result is the fresh graph's replay
    assert first[0].data_ptr() != out[0].data_ptr()


def test_param_data_rebinding_recaptures(layer: torch.nn.Linear) -> None:
    fn = ngr.make_graphed_callable(linear_relu, (torch.randn(4, 16), layer.weight, layer.bias),
                                   static_argnums=(1, 2), name="rebind")
    x = torch.randn(4, 16)
    with torch.no_grad():
        fn(x, layer.weight, layer.bias)
        fn(x, layer.weight, layer.bias)
        layer.weight.data = torch.randn(8, 16)
        for _ in range(2):
            torch.testing.assert_close(fn(x, layer.weight, layer.bias), linear_relu(x, layer.weight, layer.bias))
    assert [e.reason for e in fn.events] == ["new_key", "static_input_change"]
    assert counters()["recapture_due_to_static_input_change_rebind"] == 1


def test_new_parameter_object_recaptures(layer: torch.nn.Linear) -> None:
    fn = ngr.make_graphed_callable(linear_relu, (torch.randn(4, 16), layer.weight, layer.bias),
                                   static_argnums=(1, 2))
    x = torch.randn(4, 16)
    with torch.no_grad():
        fn(x, layer.weight, layer.bias)
        fn(x, layer.weight, layer.bias)
        layer.weight = torch.nn.Parameter(torch.randn(8, 16))
        torch.testing.assert_close(fn(x, layer.weight, layer.bias), linear_relu(x, layer.weight, layer.bias))
    assert [e.reason for e in fn.events] == ["new_key", "static_input_change"]


def test_a_different_cpu_core_limit_reuses_the_capture(layer: torch.nn.Linear) -> None:
    # a CPU capture records ops, not threads: the replay runs under the limit in force (the
    # threads seen inside a replay: test_core_limit.py; NPU limits recapture: same file)
    fn = ngr.make_graphed_callable(linear_relu, (torch.randn(4, 16), layer.weight, layer.bias),
                                   static_argnums=(1, 2), name="cores")
    with torch.no_grad():
        for limited in (False, False, True, True, False):
            x = torch.randn(4, 16)
            # the result is compared, not kept: a kept result would make the next call of the
            # same capture replay another one (held outputs)
            if limited:
                with ngr.limit_core_num(1, 0, device="cpu"):
                    torch.testing.assert_close(fn(x, layer.weight, layer.bias),
                                               linear_relu(x, layer.weight, layer.bias))
            else:
                torch.testing.assert_close(fn(x, layer.weight, layer.bias),
                                           linear_relu(x, layer.weight, layer.bias))
    assert [e.reason for e in fn.events] == ["new_key"]
    assert counters().get("recapture_due_to_core_limit_change_cores", 0) == 0


def scaled_linear_relu(x: torch.Tensor, scale: torch.Tensor, w: torch.Tensor,
                       b: torch.Tensor) -> torch.Tensor:
    return torch.relu(torch.nn.functional.linear(x * scale, w, b))


@pytest.mark.parametrize("rebound", ["first", "last"])
def test_frozen_checks_the_first_and_last_static_address(layer: torch.nn.Linear,
                                                        rebound: str) -> None:
    # check_static_addresses=False (frozen_parameter): the first and the last static input
    # stand for the instance; a re-bound one between them is the documented blind spot
    scale = torch.rand(16)
    fn = ngr.make_graphed_callable(scaled_linear_relu,
                                   (torch.randn(4, 16), scale, layer.weight, layer.bias),
                                   static_argnums=(1, 2, 3), check_static_addresses=False)
    x = torch.randn(4, 16)
    with torch.no_grad():
        fn(x, scale, layer.weight, layer.bias)
        layer.weight.data = torch.randn(8, 16)
        fn(x, scale, layer.weight, layer.bias)
        assert [e.reason for e in fn.events] == ["new_key"]
        if rebound == "first":
            scale = torch.rand(16)
        else:
            layer.bias.data = torch.randn(8)
        torch.testing.assert_close(fn(x, scale, layer.weight, layer.bias),
                                   scaled_linear_relu(x, scale, layer.weight, layer.bias))
    assert [e.reason for e in fn.events] == ["new_key", "static_input_change"]


def test_capture_limit_falls_back_with_one_warning(layer: torch.nn.Linear) -> None:
    fn = ngr.make_graphed_callable(linear_relu, (torch.randn(1, 16), layer.weight, layer.bias),
                                   static_argnums=(1, 2), capture_limit=2, name="limited")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (1, 2, 1, 2, 3, 4, 3, 1):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(fn(x, layer.weight, layer.bias), linear_relu(x, layer.weight, layer.bias))
    limit_warnings = [w for w in caught if "capture_limit=2" in str(w.message)]
    assert len(limit_warnings) == 1
    assert fn.fell_back and fn.fallback_reason == "capture_limit"
    assert fn.num_captures == 0 and fn.graphs == {}
    assert counters()["eager_fallback_due_to_capture_limit_limited"] == 1
    assert "captured_limited" not in counters()  # a callable holding no graph has no counter


def test_capture_limit_warning_is_a_user_warning(layer: torch.nn.Linear) -> None:
    fn = ngr.make_graphed_callable(linear_relu, (torch.randn(1, 16), layer.weight, layer.bias),
                                   static_argnums=(1, 2), capture_limit=1)
    with torch.no_grad():
        fn(torch.randn(1, 16), layer.weight, layer.bias)
        with pytest.warns(UserWarning, match="capture_limit=1 reached"):
            fn(torch.randn(2, 16), layer.weight, layer.bias)


def test_static_outputs_are_the_same_tensors_every_call(layer: torch.nn.Linear) -> None:
    fn = ngr.make_graphed_callable(linear_relu, (torch.randn(4, 16), layer.weight, layer.bias),
                                   static_argnums=(1, 2))
    with torch.no_grad():
        fn(torch.randn(4, 16), layer.weight, layer.bias)  # warmup + capture: eager result
        x1, x2 = torch.randn(4, 16), torch.randn(4, 16)
        (out1,) = fn(x1, layer.weight, layer.bias)
        first = out1.clone()
        (out2,) = fn(x2, layer.weight, layer.bias)
        del out1, out2
        (out3,) = fn(x1, layer.weight, layer.bias)
        (out4,) = fn(x2, layer.weight, layer.bias)
        torch.testing.assert_close(out3, first)  # held: the next call replayed another capture
        torch.testing.assert_close(out4, linear_relu(x2, layer.weight, layer.bias)[0])
        del out4
        (out5,) = fn(x2, layer.weight, layer.bias)
    # two captures, alternating: the one whose outputs the caller dropped replays again
    assert out5 is not out3 and fn.num_captures == 2, fn.events


def test_clone_output_returns_fresh_tensors(layer: torch.nn.Linear) -> None:
    fn = ngr.make_graphed_callable(linear_relu, (torch.randn(4, 16), layer.weight, layer.bias),
                                   static_argnums=(1, 2), clone_output=True)
    with torch.no_grad():
        fn(torch.randn(4, 16), layer.weight, layer.bias)
        x1, x2 = torch.randn(4, 16), torch.randn(4, 16)
        (out1,) = fn(x1, layer.weight, layer.bias)
        (out2,) = fn(x2, layer.weight, layer.bias)
    assert out1.untyped_storage().data_ptr() != out2.untyped_storage().data_ptr()
    torch.testing.assert_close(out1, linear_relu(x1, layer.weight, layer.bias)[0])
    torch.testing.assert_close(out2, linear_relu(x2, layer.weight, layer.bias)[0])


def test_clone_input_never_writes_the_callers_tensors() -> None:
    fn = ngr.make_graphed_callable(lambda x, y: (x * y + 1,), (torch.randn(3, 5), torch.randn(3, 5)))
    inputs = [(torch.randn(3, 5), torch.randn(3, 5).t().contiguous().t()) for _ in range(4)]
    kept = [(x.clone(), y.clone()) for x, y in inputs]
    for x, y in inputs:
        torch.testing.assert_close(fn(x, y)[0], x * y + 1)
    for (x, y), (kx, ky) in zip(inputs, kept, strict=True):
        assert torch.equal(x, kx) and torch.equal(y, ky)


def test_clone_input_false_copies_into_the_first_calls_tensors() -> None:
    fn = ngr.make_graphed_callable(lambda x: (x.exp(),), (torch.randn(6),), clone_input=False)
    first = torch.randn(6)
    torch.testing.assert_close(fn(first)[0], first.exp())
    same = first.clone()
    torch.testing.assert_close(fn(first)[0], same.exp())
    second = torch.randn(6)
    torch.testing.assert_close(fn(second)[0], second.exp())
    assert torch.equal(first, second)  # the documented caveat: the first tensor was overwritten
    assert fn.num_captures == 1 and len(fn.events) == 1


def counting_step(x: torch.Tensor, calls: torch.Tensor) -> torch.Tensor:
    calls.add_(1)
    return x * calls


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_warmup_applies_side_effects_once_per_call(warmup: int) -> None:
    calls = torch.zeros(1)
    fn = ngr.make_graphed_callable(counting_step, (torch.ones(2), calls), mutated_argnums=(1,),
                                   warmup=warmup)
    for n in range(1, 5):
        x = torch.randn(2)
        torch.testing.assert_close(fn(x, calls), x * n)
        assert calls.item() == n
    assert len(fn.events) == 1


def test_warmup_zero_returns_the_static_outputs_from_the_first_call(layer: torch.nn.Linear) -> None:
    fn = ngr.make_graphed_callable(linear_relu, (torch.randn(4, 16), layer.weight, layer.bias),
                                   static_argnums=(1, 2), warmup=0)
    with torch.no_grad():
        x1, x2 = torch.randn(4, 16), torch.randn(4, 16)
        (out1,) = fn(x1, layer.weight, layer.bias)
        torch.testing.assert_close(out1, linear_relu(x1, layer.weight, layer.bias)[0])
        (out2,) = fn(x2, layer.weight, layer.bias)
        torch.testing.assert_close(out1, linear_relu(x1, layer.weight, layer.bias)[0])  # kept
    assert out1 is not out2


def test_force_eager_never_captures(layer: torch.nn.Linear) -> None:
    fn = ngr.make_graphed_callable(linear_relu, (torch.randn(4, 16), layer.weight, layer.bias),
                                   static_argnums=(1, 2), force_eager=True, name="eager_only")
    with torch.no_grad():
        outs = []
        for _ in range(3):
            x = torch.randn(4, 16)
            (out,) = fn(x, layer.weight, layer.bias)
            torch.testing.assert_close(out, linear_relu(x, layer.weight, layer.bias)[0])
            outs.append(out)
    assert fn.num_captures == 0 and fn.events == [] and fn.fell_back
    assert len({o.data_ptr() for o in outs}) == 3
    assert counters()["eager_fallback_due_to_force_eager_eager_only"] == 1


def test_a_transformer_layer_replays_each_batch_size_like_eager() -> None:
    layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True).eval()
    fn = ngr.make_graphed_callable(layer, (torch.randn(2, 5, 32),))
    with torch.no_grad():
        for batch in (2, 3, 2, 3):
            x = torch.randn(batch, 5, 32)
            torch.testing.assert_close(fn(x), layer(x))
    f32 = (torch.float32, torch.device("cpu"))
    assert [e.key for e in fn.events] == [(3, 2, 5, 32, *f32), (3, 3, 5, 32, *f32)]


def held_bytes(fn: ngr.GraphedCallable) -> int:
    pools = {repr(g.pool().ident): g.pool() for g in fn.graphs.values()}
    return sum(ngr.pool_bytes(p) for p in pools.values())


def test_shared_pool_holds_fewer_bytes_than_private_pools(
    make_mlp: Callable[..., torch.nn.Module],
) -> None:
    model = make_mlp((32, 64, 64, 16))
    held = {}
    for pool in ("shared", "private"):
        fn = ngr.make_graphed_callable(model, (torch.randn(16, 32),), pool=pool)
        with torch.no_grad():
            for rows in (16, 8, 4, 2, 1):
                x = torch.randn(rows, 32)
                fn(x)
                torch.testing.assert_close(fn(x), model(x))
        assert fn.num_captures == 5
        held[pool] = held_bytes(fn)
    assert len({repr(g.pool().ident) for g in fn.graphs.values()}) == 5  # private: one each
    assert held["shared"] < held["private"]


def test_a_given_pool_is_used_for_every_capture(make_mlp: Callable[..., torch.nn.Module]) -> None:
    model = make_mlp()
    pool = ngr.graph_pool_handle("cpu")
    fn = ngr.make_graphed_callable(model, (torch.randn(4, 32),), pool=pool)
    with torch.no_grad():
        for rows in (4, 2):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(fn(x), model(x))
    assert all(g.pool() == pool for g in fn.graphs.values())


def update_and_return_cache(x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cache.mul_(0.5).add_(x)
    return cache, cache.sum() + x


@pytest.mark.parametrize("clone_output", [False, True])
def test_an_output_aliasing_a_mutated_input_is_returned_as_that_input(clone_output: bool) -> None:
    cache = torch.zeros(4)
    eager = cache.clone()
    spec = InputSpec((SlotKind.USER, SlotKind.MUTATED), ((), ()))
    fn = ngr.GraphedCallable(update_and_return_cache, spec, CapturePolicy(clone_output=clone_output),
                             output_spec=OutputSpec((1, None)))
    for _ in range(3):
        x = torch.randn(4)
        got, total = fn(x, cache)
        want, want_total = update_and_return_cache(x, eager)
        assert got is cache
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(total, want_total)


def test_a_view_of_a_mutated_input_is_never_cloned() -> None:
    def head_of_cache(x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache.add_(x)
        return cache[:2], x * 2

    cache = torch.zeros(4)
    eager = cache.clone()
    spec = InputSpec((SlotKind.USER, SlotKind.MUTATED), ((), ()))
    fn = ngr.GraphedCallable(head_of_cache, spec, CapturePolicy(clone_output=True),
                             output_spec=OutputSpec((1, None)))
    for _ in range(3):
        x = torch.randn(4)
        head, twice = fn(x, cache)
        want_head, want_twice = head_of_cache(x, eager)
        assert head.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
        torch.testing.assert_close(head, want_head)
        torch.testing.assert_close(twice, want_twice)


def test_an_output_that_is_a_user_input_is_returned_as_that_input() -> None:
    def passthrough(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x + y

    fn = ngr.make_graphed_callable(passthrough, (torch.randn(3), torch.randn(3)))
    for _ in range(3):
        x, y = torch.randn(3), torch.randn(3)
        same, total = fn(x, y)
        assert same is x
        torch.testing.assert_close(total, x + y)


def test_a_list_returning_fn_gets_a_list_and_a_tensor_returning_fn_a_tensor(
    make_mlp: Callable[..., torch.nn.Module],
) -> None:
    model = make_mlp()
    as_list = ngr.make_graphed_callable(lambda x: [model(x), x.sum()], (torch.randn(2, 32),))
    bare = ngr.make_graphed_callable(model, (torch.randn(2, 32),))
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 32)
            got = as_list(x)
            assert isinstance(got, list)
            torch.testing.assert_close(got, [model(x), x.sum()])
            torch.testing.assert_close(bare(x), model(x))


def test_unsafe_op_during_capture_raises_and_captures_nothing() -> None:
    def syncs(x: torch.Tensor) -> torch.Tensor:
        return x * x.sum().item()

    fn = ngr.make_graphed_callable(syncs, (torch.randn(3),))
    with pytest.raises(ngr.CaptureError):
        fn(torch.randn(3))
    assert fn.num_captures == 0 and fn.events == []


def test_reset_releases_every_graph_and_captures_again(layer: torch.nn.Linear) -> None:
    fn = ngr.make_graphed_callable(linear_relu, (torch.randn(4, 16), layer.weight, layer.bias),
                                   static_argnums=(1, 2))
    x = torch.randn(4, 16)
    with torch.no_grad():
        fn(x, layer.weight, layer.bias)
        fn.reset()
        assert fn.num_captures == 0
        fn(x, layer.weight, layer.bias)
        torch.testing.assert_close(fn(x, layer.weight, layer.bias), linear_relu(x, layer.weight, layer.bias))
    assert [e.reason for e in fn.events] == ["new_key", "new_key"]


def test_bad_arguments_are_refused_with_the_name_of_what_to_change() -> None:
    with pytest.raises(ngr.PolicyError, match="unknown capture policy warmups"):
        ngr.make_graphed_callable(torch.sin, (torch.randn(2),), warmups=2)
    fn = ngr.make_graphed_callable(torch.sin, (torch.randn(2),))
    with pytest.raises(ngr.PolicyError, match="called with 2 arguments"):
        fn(torch.randn(2), torch.randn(2))
    with pytest.raises(ngr.PolicyError, match="input 0 is user"):
        fn(3.0)


def test_replays_and_captures_show_as_profiler_ranges_only_while_profiling(layer: torch.nn.Linear) -> None:
    fn = ngr.make_graphed_callable(linear_relu, (torch.randn(4, 16), layer.weight, layer.bias),
                                   static_argnums=(1, 2), warmup=0)
    x = torch.randn(4, 16)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(x, layer.weight, layer.bias)  # capture + replay
        out = fn(x, layer.weight, layer.bias)  # replay
    names = [e.name for e in prof.events()]
    assert names.count("npugraph_ex::capture") == 1
    assert names.count("npugraph_ex::replay") == 2
    torch.testing.assert_close(out, linear_relu(x, layer.weight, layer.bias))
    with torch.no_grad():
        torch.testing.assert_close(fn(x, layer.weight, layer.bias), linear_relu(x, layer.weight, layer.bias))


# --- input and output policies against eager -------------------------------------------------
def _add_to_first_column(x: torch.Tensor) -> torch.Tensor:
    x[:, 0].add_(1)
    return x.sum(1)


def test_clone_input_false_same_address_other_strides_is_refused_not_replayed(assert_same: AssertSame) -> None:
    """Same address and shape, other strides: the old layout must not be replayed, and copying
    base.t() into base would transpose the caller's tensor."""
    base = torch.randn(4, 4)
    kept = base.clone()
    fn = ngr.make_graphed_callable(lambda x: x.cumsum(1), [base], clone_input=False)
    assert_same(fn(base), kept.cumsum(1))
    with pytest.raises(PolicyError, match="clone_input=False: input 0's capture buffer"):
        fn(base.t())
    assert torch.equal(base, kept)
    assert_same(fn(base), kept.cumsum(1))
    other = torch.randn(4, 4).t()  # another address, transposed: copied into the buffer
    assert_same(fn(other), other.cumsum(1))


def test_clone_input_false_inputs_aliased_at_capture_then_distinct(assert_same: AssertSame) -> None:
    t = torch.randn(5)
    fn = ngr.make_graphed_callable(lambda a, b: a - b, [t, t], clone_input=False)
    assert_same(fn(t, t), torch.zeros(5))
    u, v = torch.randn(5), torch.randn(5)
    assert_same(fn(u, v), u - v)
    assert_same(fn(t, t), torch.zeros(5))


def test_clone_input_false_swapped_inputs_are_refused_and_left_intact(assert_same: AssertSame) -> None:
    a, b = torch.randn(5), torch.randn(5)
    kept_a, kept_b = a.clone(), b.clone()
    fn = ngr.make_graphed_callable(lambda x, y: x * 2 - y, [a, b], clone_input=False)
    assert_same(fn(a, b), kept_a * 2 - kept_b)
    with pytest.raises(PolicyError, match="clone_input=False"):
        fn(b, a)  # refilling either buffer would overwrite the other input of this call
    assert torch.equal(a, kept_a) and torch.equal(b, kept_b)


def test_clone_input_false_overlapping_window_is_refused_disjoint_window_is_copied(assert_same: AssertSame) -> None:
    big = torch.randn(20)
    kept = big.clone()
    fn = ngr.make_graphed_callable(lambda x: x * 3 + 1, [big[0:8]], clone_input=False)
    assert_same(fn(big[0:8]), kept[0:8] * 3 + 1)
    with pytest.raises(PolicyError, match="clone_input=False"):
        fn(big[3:11])
    assert torch.equal(big, kept)
    # a disjoint window is copied into the first call's tensor: the documented caveat
    assert_same(fn(big[10:18]), kept[10:18] * 3 + 1)
    assert torch.equal(big[8:], kept[8:]) and torch.equal(big[0:8], kept[10:18])


def test_clone_input_true_windows_of_one_tensor_leave_it_intact(assert_same: AssertSame) -> None:
    big = torch.randn(8, 8)
    kept = big.clone()
    fn = ngr.make_graphed_callable(lambda x: x.softmax(-1), [big[2:6, 1:5]])
    for r in range(4):
        assert_same(fn(big[r:r + 4, r + 1:r + 5]), kept[r:r + 4, r + 1:r + 5].softmax(-1))
    assert torch.equal(big, kept)


def test_a_view_of_an_input_fed_back_as_the_next_input(assert_same: AssertSame) -> None:
    """Outputs that view a user input are views of the caller's tensor (as in eager), never of a
    capture buffer, so feeding them back cannot change them while the buffers are refilled."""
    def rotate(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.t(), x[:2] + y

    x, y = torch.randn(4, 4), torch.randn(2, 4)
    fn = ngr.make_graphed_callable(rotate, [x, y])
    ex, ey = x.clone(), y.clone()
    for _ in range(4):
        x, y = fn(x, y)
        ex, ey = rotate(ex, ey)
        assert_same((x, y), (ex, ey))


def test_clone_input_false_expanded_first_input(assert_same: AssertSame) -> None:
    def make() -> list[torch.Tensor]:
        return [torch.randn(4, 1).expand(4, 6), torch.randn(6)]

    first = make()
    fn = ngr.make_graphed_callable(lambda x, y: x * y, first, clone_input=False)
    for args in (first, make(), make()):
        assert_same(fn(*args), args[0] * args[1])


def test_clone_input_false_sees_the_same_tensor_mutated_between_calls(assert_same: AssertSame) -> None:
    x = torch.randn(4, 4)
    fn = ngr.make_graphed_callable(lambda a: a @ a, [x], clone_input=False)
    for _ in range(3):
        assert_same(fn(x), x @ x)
        x.mul_(-0.5).add_(1)


@pytest.mark.parametrize("clone_input", [True, False])
def test_undeclared_in_place_write_to_a_user_input_is_refused(clone_input: bool) -> None:
    fn = ngr.make_graphed_callable(_add_to_first_column, [torch.randn(4, 5)], clone_input=clone_input)
    with pytest.raises(PolicyError, match=r"writes input 0 in place .*aten\.add_.*mutated_argnums"):
        fn(torch.randn(4, 5))
    assert fn.num_captures == 0


def test_declared_in_place_write_to_an_input_matches_eager(assert_same: AssertSame) -> None:
    fn = ngr.make_graphed_callable(_add_to_first_column, [torch.randn(4, 5)], mutated_argnums=(0,))
    for _ in range(3):
        x = torch.randn(4, 5)
        eager = x.clone()
        want = _add_to_first_column(eager)
        assert_same(fn(x), want)
        assert torch.equal(x, eager)


def _scale_state(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    state.mul_(2).add_(x)
    return state.sum() + x


def test_undeclared_in_place_write_to_a_static_input_is_refused() -> None:
    """Warmups would apply the write more than once, and the spec promises statics never change."""
    state = torch.randn(4)
    kept = state.clone()
    fn = ngr.make_graphed_callable(_scale_state, [state, torch.randn(4)], static_argnums=(0,), warmup=3)
    with pytest.raises(PolicyError, match="writes input 0 in place"):
        fn(state, torch.randn(4))
    assert not torch.equal(state, kept)  # the eager warmups ran; nothing was captured
    assert fn.num_captures == 0


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_mutated_input_with_warmups_is_written_once_per_call(warmup: int, assert_same: AssertSame) -> None:
    state = torch.randn(4)
    eager = state.clone()
    fn = ngr.make_graphed_callable(_scale_state, [state, torch.randn(4)], mutated_argnums=(0,),
                                   warmup=warmup)
    for _ in range(4):
        x = torch.randn(4)
        want = _scale_state(eager, x.clone())
        assert_same(fn(state, x), want)
        assert torch.equal(state, eager)


def test_user_input_sharing_memory_with_a_mutated_input_is_refused() -> None:
    def bump_then_read(cache: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cache.add_(1)
        return x * 2

    t = torch.randn(5)
    fn = ngr.make_graphed_callable(bump_then_read, [t, t], mutated_argnums=(0,))
    with pytest.raises(PolicyError, match="user input 1 shares memory with mutated input 0"):
        fn(t, t)


def test_nested_outputs_are_cloned_when_clone_output(assert_same: AssertSame) -> None:
    def nested(a: torch.Tensor) -> tuple[Any, ...]:
        return a * 2, [a + 1, (a - 1, None)], 3

    fn = ngr.make_graphed_callable(nested, [torch.randn(4)], clone_output=True)
    fn(torch.randn(4))
    x1 = torch.randn(4)
    first = fn(x1)
    fn(torch.randn(4))  # a replay must not overwrite what the previous call returned
    assert_same(first, nested(x1))
    assert isinstance(first[1], list) and isinstance(first[1][1], tuple)


def test_nested_output_that_is_the_input_is_returned_as_the_input(assert_same: AssertSame) -> None:
    fn = ngr.make_graphed_callable(lambda a: (a * 2, [a]), [torch.randn(3)])
    for _ in range(3):
        x = torch.randn(3)
        got = fn(x)
        assert got[1][0] is x
        assert_same(got, (x * 2, [x]))


def test_a_dict_inside_the_result_is_refused() -> None:
    fn = ngr.make_graphed_callable(lambda a: (a, {"y": a * 2}), [torch.randn(3)])
    with pytest.raises(CaptureError, match="returned a dict inside its result"):
        fn(torch.randn(3))


def test_capture_limit_one_then_new_shapes_run_eagerly_and_keep_old_results(assert_same: AssertSame) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x.softmax(-1) * 3).cumsum(-1)

    graphed = ngr.make_graphed_callable(fn, [torch.randn(2, 3)], capture_limit=1)
    kept = None
    with pytest.warns(UserWarning, match="capture_limit=1"):
        for shape in [(2, 3), (2, 3), (4, 3), (2, 3), (5, 5)]:
            x = torch.randn(*shape)
            got = graphed(x)
            assert_same(got, fn(x))
            if kept is None:
                kept = (got, got.clone())
    assert graphed.fell_back
    assert kept is not None and torch.equal(*kept)


def test_replay_after_the_callers_locals_died_and_gc(assert_same: AssertSame) -> None:
    def build() -> tuple[Any, torch.Tensor]:
        weight = torch.randn(6, 6)
        fn = ngr.make_graphed_callable(lambda x, w: (x @ w).relu(), [torch.randn(3, 6), weight],
                                       static_argnums=(1,))
        return fn, weight

    fn, weight = build()
    gc.collect()
    for _ in range(3):
        x = torch.randn(3, 6)
        got = fn(x, weight)
        gc.collect()
        assert_same(got, (x @ weight).relu())


def test_replay_in_another_thread() -> None:
    weight = torch.randn(6, 6)
    fn = ngr.make_graphed_callable(lambda x, w: (x @ w).tanh(), [torch.randn(3, 6), weight],
                                   static_argnums=(1,))
    fn(torch.randn(3, 6), weight)
    results: list[bool] = []

    def work() -> None:
        for rows in (3, 5):  # one replay, one capture in this thread
            x = torch.randn(rows, 6)
            results.append(torch.equal(fn(x, weight), (x @ weight).tanh()))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert results == [True, True]


@pytest.mark.parametrize("clone_input", [True, False])
@pytest.mark.parametrize(
    "fn",
    [lambda x: x.t().view(-1) * 2, lambda x: x.as_strided((3,), (1,)) * 2],
    ids=["view_valid_only_for_the_input_layout", "as_strided"],
)
def test_owned_input_buffers_keep_the_callers_layout(
    fn: Callable[[torch.Tensor], torch.Tensor], clone_input: bool, assert_same: AssertSame
) -> None:
    def make() -> torch.Tensor:
        return torch.randn(4, 3).t()

    first = make()
    # clone_input=False owns a buffer too when the first tensor shares memory with another input
    args = (first,) if clone_input else (first, first)
    graphed = ngr.make_graphed_callable((lambda x, *_: fn(x)), args, clone_input=clone_input,
                                        static_argnums=() if clone_input else (1,))
    for call in range(3):
        x = first if call == 0 else make()
        assert_same(graphed(x, *args[1:]), fn(x))


def _outputs_sharing_memory(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    y = x * 2
    return y, y.view(-1), y[1], y.view(torch.int32), x + 1


def test_clone_output_keeps_outputs_that_share_memory_sharing_it(assert_same: AssertSame) -> None:
    fn = ngr.make_graphed_callable(_outputs_sharing_memory, [torch.randn(2, 3)], clone_output=True)
    fn(torch.randn(2, 3))
    for _ in range(2):
        x = torch.randn(2, 3)
        got, want = fn(x), _outputs_sharing_memory(x)
        assert_same(got, want)
        got[0].add_(1)  # a write through one output shows through its aliases, as in eager
        want[0].add_(1)
        assert_same(got, want)
        assert got[0].untyped_storage().data_ptr() != got[4].untyped_storage().data_ptr()


def _scaled_by_constants(x: torch.Tensor, scale: float, flag: bool, name: str) -> torch.Tensor:
    if name != "a":
        return x + 100
    return x * scale if flag else x - scale


def test_float_and_bool_inputs_select_graphs_and_a_changed_constant_is_refused(assert_same: AssertSame) -> None:
    fn = ngr.make_graphed_callable(_scaled_by_constants, [torch.randn(3), 0.5, True, "a"])
    for scale, flag in [(0.5, True), (0.7, True), (0.5, False), (0.7, True)]:
        x = torch.randn(3)
        assert_same(fn(x, scale, flag, "a"), _scaled_by_constants(x, scale, flag, "a"))
    assert fn.num_captures == 3
    with pytest.raises(PolicyError, match="constant input 3 is 'b' but the graph was captured with 'a'"):
        fn(torch.randn(3), 0.5, True, "b")


def test_the_capture_write_watch_lets_higher_order_operators_through(assert_same: AssertSame) -> None:
    """The manager watches writes during captures on every device; on CUDA a graph may hold a
    higher-order operator (torch.cond), which must run as without the watch."""
    from npugraph_runtime.inputs import WriteWatch

    x = torch.randn(4)
    with WriteWatch({}):
        got = torch.cond(x.sum() > 0, lambda v: v.sin(), lambda v: v.cos(), (x,))
    assert_same(got, x.sin() if x.sum() > 0 else x.cos())


def _decay_cache(cache: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    cache[:, 0].add_(x)
    cache.mul_(0.5)
    return cache.sum(1) + x


def test_mutated_input_passed_as_a_view_of_a_bigger_tensor(assert_same: AssertSame) -> None:
    big = torch.randn(4, 8)
    eager_big = big.clone()
    fn = ngr.make_graphed_callable(_decay_cache, [big[:, 2:6], torch.randn(4)], mutated_argnums=(0,))
    for call in range(5):
        start = 2 if call < 3 else 1  # a new view (new address) recaptures
        x = torch.randn(4)
        want = _decay_cache(eager_big[:, start:start + 4], x.clone())
        assert_same(fn(big[:, start:start + 4], x), want)
        assert torch.equal(big, eager_big)
    assert [e.reason for e in fn.events] == ["new_key", "mutated_input_change"]


def append_and_read(cache: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cache.add_(x)
    return cache.sum(0), cache[0]  # cache[0]: a view of the caller's cache, as in eager


def project(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x @ w, w.t()  # w.t(): a view of the caller's weight


@pytest.mark.parametrize("clone_output", [False, True])
@torch.no_grad()
def test_view_of_a_mutated_input_is_the_callers_view(clone_output: bool, device: str) -> None:
    # clone_output=True once cloned cache[0]: the kept result stopped following the cache
    cache, want_cache = torch.zeros(4, 8, device=device), torch.zeros(4, 8, device=device)
    fn = ngr.make_graphed_callable(append_and_read, (cache, torch.randn(4, 8, device=device)),
                                   mutated_argnums=(0,), clone_output=clone_output)
    kept = []
    for _ in range(6):
        x = torch.randn(4, 8, device=device)
        got, want = fn(cache, x), append_and_read(want_cache, x)
        kept.append((got, want))
        for g, w in kept:
            torch.testing.assert_close(g[0], w[0])
            torch.testing.assert_close(g[1], w[1])  # a live view of the cache, in both
    assert fn.num_captures >= 1 and fn.events[0].reason == "new_key"


@pytest.mark.parametrize("clone_output", [False, True])
@torch.no_grad()
def test_view_of_a_static_input_is_the_callers_view(clone_output: bool, device: str) -> None:
    w = torch.randn(8, 8, device=device)
    fn = ngr.make_graphed_callable(project, (torch.randn(4, 8, device=device), w),
                                   static_argnums=(1,), clone_output=clone_output)
    for _ in range(6):
        x = torch.randn(4, 8, device=device)
        out, wt = fn(x, w)
        torch.testing.assert_close(out, x @ w)
        assert wt.data_ptr() == w.data_ptr() and wt.stride() == w.t().stride()
    assert fn.num_captures >= 1


# --- calls that need autograd, inference mode ------------------------------------------------
CALLS = 6
POLICIES = [{}, {"clone_output": True}, {"clone_input": False}, {"force_recapture": True}]


def _scaled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return ((x * 2) @ w).tanh()


def _shifted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x + w[0]  # saves nothing for backward: a stale autograd graph raised no error


def _grads(out: torch.Tensor, *leaves: torch.Tensor) -> list[torch.Tensor | None]:
    for t in leaves:
        t.grad = None
    out.sum().backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: ",".join(p) or "default")
@pytest.mark.parametrize("fn", [_scaled, _shifted], ids=lambda f: f.__name__)
def test_calls_needing_autograd_get_eager_gradients_and_inference_calls_replay(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], policy: dict[str, Any]
) -> None:
    """A replay's outputs carry no autograd history of the call (only, at best, the capture's):
    a backward left x.grad None, or failed with a saved tensor modified in place. A call that
    needs autograd must run eagerly; the inference calls beside it still replay."""
    npugraph_ex_counters().clear()
    w = torch.randn(8, 8, requires_grad=True)
    g = ngr.make_graphed_callable(fn, (torch.randn(4, 8), w), static_argnums=(1,), **policy)
    with pytest.warns(UserWarning, match="grad mode on and input 0 requiring grad"):
        for i in range(CALLS):
            x = torch.randn(4, 8, requires_grad=True)
            x_eager = x.detach().clone().requires_grad_(True)
            got, want = g(x, w), fn(x_eager, w)
            torch.testing.assert_close(got, want)
            assert got.requires_grad
            for a, b in zip(_grads(got, x, w), _grads(want, x_eager, w), strict=True):
                assert a is not None and b is not None, f"call {i}: a gradient is None"
                torch.testing.assert_close(a, b)
            with torch.no_grad():  # inference calls: captured once, then replayed
                x = torch.randn(4, 8)
                torch.testing.assert_close(g(x, w), fn(x, w))
    assert g.num_captures >= 1
    assert npugraph_ex_counters()[f"eager_call_due_to_requires_grad_{g.name}"] == CALLS


def test_a_static_only_callable_under_grad_mode_runs_eagerly() -> None:
    """No user tensor, so no key tells a call's grad mode: the capture itself refuses to be made
    under grad mode (a second backward through the capture's graph raised)."""
    w = torch.randn(8, 8, requires_grad=True)

    def fn(w: torch.Tensor) -> torch.Tensor:
        return (w @ w).tanh()

    g = ngr.make_graphed_callable(fn, (w,), static_argnums=(0,))
    with pytest.warns(UserWarning, match="requiring grad"):
        for _ in range(CALLS):
            got, want = g(w), fn(w)
            torch.testing.assert_close(got, want)
            for a, b in zip(_grads(got, w), _grads(want, w), strict=True):
                assert a is not None and b is not None
                torch.testing.assert_close(a, b)
    assert g.num_captures == 0
    with torch.no_grad():
        for _ in range(CALLS):
            torch.testing.assert_close(g(w), fn(w))
    assert g.num_captures == 1


def _use(out: torch.Tensor) -> str:
    """What a caller outside inference mode may do with an output: update it, save it."""
    try:
        out.add_(1)
        torch.nn.Linear(8, 8)(out).sum().backward()
    except RuntimeError as exc:
        return f"error: {exc}"[:90]
    return "ok"


@pytest.mark.parametrize("policy", POLICIES[:3], ids=lambda p: ",".join(p) or "default")
@pytest.mark.parametrize("first", ["inference_mode", "no_grad"])
def test_inference_mode_and_no_grad_calls_mixed(policy: dict[str, Any], first: str) -> None:
    """A capture made in inference mode holds inference tensors: a later call under no_grad
    raised "Inplace update to inference tensor outside InferenceMode" refilling its input
    buffer, and the outputs a replay returned were inference tensors where eager's are not
    (and the other way round)."""
    w = torch.randn(8, 8)

    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x @ w).relu(), x.sum(0)

    g = ngr.make_graphed_callable(fn, (torch.randn(4, 8), w), static_argnums=(1,), **policy)
    other = "no_grad" if first == "inference_mode" else "inference_mode"
    for i, mode in enumerate([first, other, other, first, other, first]):
        x = torch.randn(4, 8)
        with getattr(torch, mode)():
            got, want = g(x, w), fn(x, w)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
            assert a.is_inference() == b.is_inference(), f"call {i} ({mode})"
        assert _use(got[0]) == _use(want[0]), f"call {i} ({mode})"
    assert g.num_captures >= 2  # one per mode, each replayed


# --- mutated inputs sharing an arena, autocast keys, requests with their own caches --------
def decay_into_cache(cache: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    cache.mul_(0.5).add_(x.sum(0))
    return cache * 2 + x[:1]


@pytest.mark.parametrize("clone_input", [True, False])
@torch.no_grad()
def test_user_input_cut_from_the_mutated_inputs_arena_without_overlap(clone_input: bool) -> None:
    # a KV cache and a scratch input cut from one arena: same storage, no shared byte, so the
    # replay reads the input as eager does (it used to be refused as sharing memory)
    arena, eager_arena = torch.zeros(10, 4), torch.zeros(10, 4)
    fn = ngr.make_graphed_callable(decay_into_cache, (arena[:6], arena[6:]), mutated_argnums=(0,),
                                   clone_input=clone_input, name=f"arena_{clone_input}")
    for _ in range(6):
        scratch = torch.randn(4, 4)
        arena[6:].copy_(scratch)
        eager_arena[6:].copy_(scratch)
        torch.testing.assert_close(fn(arena[:6], arena[6:]),
                                   decay_into_cache(eager_arena[:6], eager_arena[6:]))
        torch.testing.assert_close(arena, eager_arena)
    assert npugraph_ex_counters()[f"captured_arena_{clone_input}"] == 1


def test_user_input_overlapping_a_mutated_input_is_refused() -> None:
    arena = torch.zeros(10, 4)
    fn = ngr.make_graphed_callable(decay_into_cache, (arena[:6], arena[5:]), mutated_argnums=(0,),
                                   name="arena_overlap")
    with pytest.raises(ngr.PolicyError, match="user input 1 shares memory with mutated input 0"):
        fn(arena[:6], arena[5:])


def reads_the_arena_through_as_strided(cache: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    cache.add_(1)
    return x.as_strided((4,), (1,), 0) * 2  # storage offset 0: the cache's bytes


def test_disjoint_user_input_read_through_as_strided_into_the_mutated_bytes_is_refused() -> None:
    arena = torch.zeros(10, 4)
    fn = ngr.make_graphed_callable(reads_the_arena_through_as_strided, (arena[:6], arena[6:]),
                                   mutated_argnums=(0,), name="arena_as_strided")
    with pytest.raises(ngr.PolicyError, match="user input 1 shares memory with mutated input 0"):
        fn(arena[:6], arena[6:])


def relu_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w)


@torch.no_grad()
def test_autocast_state_selects_its_own_hand_written_graph() -> None:
    # captured in float32, then called under bf16 autocast (and back): eager computes in other
    # dtypes, so a replay of the float32 capture would return float32 values
    w = torch.randn(16, 8)
    fn = ngr.make_graphed_callable(relu_matmul, (torch.randn(4, 16), w), static_argnums=(1,),
                                   name="autocast")
    for call in range(6):
        x = torch.randn(4, 16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=call % 2 == 1):
            got, want = fn(x, w), relu_matmul(x, w)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)
    assert fn.num_captures == 2
    assert npugraph_ex_counters()["capture_due_to_new_key_autocast"] == 2


def write_kv(x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(0, pos, x)
    return cache.sum(0) * 1.5


@torch.no_grad()
def test_requests_with_their_own_caches_served_in_turn_replay_their_own_captures() -> None:
    # three requests, each with its own KV cache (a mutated input), decoded round-robin: each
    # cache gets its capture once, instead of a recapture on every call
    caches = [torch.zeros(8, 4) for _ in range(3)]
    eager = [c.clone() for c in caches]
    fn = ngr.make_graphed_callable(write_kv, (torch.randn(1, 4), torch.tensor([0]), caches[0]),
                                   mutated_argnums=(2,), name="requests")
    for step in range(5):
        for ours, ref in zip(caches, eager, strict=True):
            x, pos = torch.randn(1, 4), torch.tensor([step])
            torch.testing.assert_close(fn(x, pos, ours), write_kv(x, pos, ref))
            torch.testing.assert_close(ours, ref)
    assert fn.num_captures == 3
    assert npugraph_ex_counters()["recapture_due_to_mutated_input_change_requests"] == 2
    # a finished request drops its cache: the next request's capture replaces that one, so the
    # dropped cache is not kept alive by the capture
    dropped = weakref.ref(caches[1])
    del caches[1], eager[1]
    fresh, fresh_ref = torch.zeros(8, 4), torch.zeros(8, 4)
    for step in range(5):
        x, pos = torch.randn(1, 4), torch.tensor([step])
        torch.testing.assert_close(fn(x, pos, fresh), write_kv(x, pos, fresh_ref))
    torch.testing.assert_close(fresh, fresh_ref)
    assert fn.num_captures == 3
    assert dropped() is None


def _accumulating_step(x: torch.Tensor, idx: torch.Tensor, calls: torch.Tensor,
                       kv: torch.Tensor) -> torch.Tensor:
    # neither write is idempotent: a run that was not undone shows in both
    calls.add_(1)
    kv.index_add_(0, idx, x)
    return x * calls + kv[idx]


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_capture_ahead_changes_no_state_and_later_calls_replay(
        warmup: int, assert_same: AssertSame) -> None:
    calls, kv = torch.zeros(1), torch.randn(16, 4)
    eager_calls, eager_kv = calls.clone(), kv.clone()
    args = (torch.randn(8, 4), torch.arange(8), calls, kv)
    fn = ngr.make_graphed_callable(_accumulating_step, args, mutated_argnums=(2, 3),
                                   warmup=warmup)
    before = counters()
    for rows in (8, 4):  # largest first, as capture_sizes makes them
        assert fn.capture_ahead(torch.randn(rows, 4), torch.arange(rows), calls, kv)
        assert torch.equal(calls, eager_calls) and torch.equal(kv, eager_kv)
    assert not fn.capture_ahead(torch.randn(4, 4), torch.arange(4), calls, kv)  # has one
    assert fn.num_captures == 2 and [e.reason for e in fn.events] == ["new_key"] * 2
    made = {k: v - before.get(k, 0) for k, v in counters().items()}
    assert made.get(f"capture_ahead_{fn.name}") == 2
    assert made.get(f"capture_due_to_new_key_{fn.name}") == 2
    for rows in (4, 8, 8, 4, 8):  # every later call of either size replays, equal to eager
        x, idx = torch.randn(rows, 4), torch.randperm(16)[:rows]
        want = _accumulating_step(x, idx, eager_calls, eager_kv)
        assert_same(fn(x, idx, calls, kv), want)
        assert torch.equal(calls, eager_calls) and torch.equal(kv, eager_kv)
    assert fn.num_captures == 2 and len(fn.events) == 2


def test_capture_ahead_captures_nothing_where_calls_run_eagerly() -> None:
    args = (torch.randn(8, 4), torch.arange(8), torch.zeros(1), torch.randn(16, 4))
    eager = ngr.make_graphed_callable(_accumulating_step, args, mutated_argnums=(2, 3),
                                      force_eager=True)
    assert not eager.capture_ahead(*args) and eager.num_captures == 0
    limited = ngr.make_graphed_callable(_accumulating_step, args, mutated_argnums=(2, 3),
                                        capture_limit=2)
    assert limited.capture_ahead(*args)
    # the last capture the limit allows is left for a call: taken ahead, that call would fall back
    assert not limited.capture_ahead(torch.randn(4, 4), torch.arange(4), *args[2:])
    assert limited.num_captures == 1
    limited(torch.randn(2, 4), torch.arange(2), *args[2:])
    assert limited.num_captures == 2 and not limited.fell_back
    with pytest.raises(PolicyError, match="capture_ahead was called with 2 arguments"):
        limited.capture_ahead(*args[:2])


@pytest.mark.parametrize("enabled", [True, False])
def test_no_garbage_collection_runs_while_a_capture_records(enabled: bool) -> None:
    """A full collection scans the whole heap (after a compile, more than the capture costs); it
    runs after the capture instead. The collector's state is the caller's again afterwards."""
    in_capture = [False]
    during: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and in_capture[0]:
            during.append(info["generation"])

    def fn(x: torch.Tensor) -> tuple[torch.Tensor]:
        in_capture[0] = True  # warmup=0: fn's only Python run is the capture's
        cycles = []
        for _ in range(3 * gc.get_threshold()[0]):  # enough new containers for a collection
            a: list[object] = []
            a.append(a)
            cycles.append(a)
        in_capture[0] = False
        return (x * 2,)

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    gc.callbacks.append(seen)
    try:
        g = ngr.make_graphed_callable(fn, (torch.randn(5, 3),), name="no_gc", warmup=0)
        with torch.no_grad():
            for _ in range(3):
                x = torch.randn(5, 3)
                torch.testing.assert_close(g(x)[0], x * 2)
        assert gc.isenabled() is enabled
    finally:
        gc.callbacks.remove(seen)
        (gc.enable if was else gc.disable)()
    assert counters().get("captured_no_gc", 0) == 1
    assert during == []


def test_cyclic_garbage_of_the_capture_is_not_read_as_a_held_output() -> None:
    """fn's frame kept by a reference cycle references the output; when the collector frees it
    after the capture, the output's count drops: settled with it, that read as held (a needless
    recapture per such capture)."""

    def fn(x: torch.Tensor) -> tuple[torch.Tensor]:
        out = x * 2
        cycle: list[object] = []
        cycle += [cycle, sys._getframe()]  # the frame holds ``out`` and ``cycle``
        return (out,)

    g = ngr.make_graphed_callable(fn, (torch.randn(4, 3),), name="cyclic_garbage", warmup=0)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 3)
            out = g(x)[0]
            torch.testing.assert_close(out, x * 2)
            del out
            gc.collect()
    assert [e.reason for e in g.events] == ["new_key"]
