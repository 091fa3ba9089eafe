"""GraphedCallable on the CPU device graph: keys, recaptures and their reasons, fallbacks,
input and output policies. Every result is compared with eager."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import npugraph_runtime as ngr
import pytest
import torch
import torch.nn.functional as F
from npugraph_runtime._compat import npugraph_ex_counters
from npugraph_runtime.spec import CapturePolicy, InputSpec, OutputSpec, SlotKind


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
