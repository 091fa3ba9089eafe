"""Each option of the backend, on the CPU device graph, every output compared with eager."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from npugraph_backend import EagerFallbackWarning, NpuOnlyOptionWarning, _compat


class TwoLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def compiled(fn: object, dynamic: bool = False, **options: object) -> object:
    return torch.compile(fn, backend="npugraph_ex", fullgraph=True, dynamic=dynamic,
                         options=options or None)


@torch.no_grad()
def test_default_options_capture_once_and_replay_with_eager_results(counter: Callable[[str], int]) -> None:
    model = TwoLayer()
    f = compiled(model)
    for _ in range(3):
        x = torch.randn(2, 8)
        torch.testing.assert_close(f(x), model(x))
    assert counter("capture_due_to_new_key_") == 1
    assert counter("captured_") == 1
    assert all(v > 0 for v in _compat.counters().values())  # no counter created at 0


@pytest.mark.parametrize("modes", [("inference_mode",) * 3, ("no_grad",) * 3,
                                   ("no_grad", "inference_mode") * 2],
                         ids=["inference_mode", "no_grad", "alternating"])
def test_inference_mode_is_captured_like_no_grad(modes: tuple[str, ...],
                                                 counter: Callable[[str], int]) -> None:
    model = TwoLayer()
    f = compiled(model)
    for mode in modes:
        with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
            x = torch.randn(2, 8)
            torch.testing.assert_close(f(x), model(x))
    # one capture per mode (inference mode is a key of its own); alternating replays both
    assert counter("capture_due_to_new_key_") == len(set(modes))


@torch.no_grad()
def test_capture_limit_falls_back_to_eager_with_exactly_one_warning(counter: Callable[[str], int]) -> None:
    f = compiled(lambda x: x * 2 + 1, dynamic=True, capture_limit=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (2, 3, 4, 5, 4, 6, 2, 5, 3):  # back on the captured sizes: replays
            x = torch.randn(n, 3)
            torch.testing.assert_close(f(x), x * 2 + 1)
    limit = [w for w in caught if "capture_limit" in str(w.message)]
    assert len(limit) == 1, [str(w.message) for w in caught]
    assert counter("eager_fallback_due_to_capture_limit_") >= 1
    assert counter("capture_due_to_new_key_") == 2


@torch.no_grad()
def test_clone_output_off_returns_the_same_static_buffer_every_call() -> None:
    model = TwoLayer()
    f = compiled(model)
    f(torch.randn(2, 8))  # the capture; its result is a clone, never the static buffer
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    ptr = f(x1).data_ptr()
    out2 = f(x2)  # nothing holds the first result: the same static buffer again
    assert out2.data_ptr() == ptr
    torch.testing.assert_close(out2, model(x2))
    out3 = f(x1)  # out2 is held: another capture's buffer, out2 keeps its values
    assert out3.data_ptr() != ptr
    torch.testing.assert_close(out2, model(x2))
    torch.testing.assert_close(out3, model(x1))


@torch.no_grad()
def test_clone_output_on_returns_fresh_tensors_that_stay_valid() -> None:
    model = TwoLayer()
    f = compiled(model, clone_output=True)
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    out1 = f(x1)
    out2 = f(x2)
    assert out1.untyped_storage().data_ptr() != out2.untyped_storage().data_ptr()
    torch.testing.assert_close(out1, model(x1))
    torch.testing.assert_close(out2, model(x2))


@pytest.mark.parametrize("clone_input", [True, False])
@torch.no_grad()
def test_clone_input_with_inputs_at_changing_addresses(clone_input: bool) -> None:
    model = TwoLayer()
    f = compiled(model, clone_input=clone_input)
    xs = [torch.randn(2, 8) for _ in range(4)]
    kept = [x.clone() for x in xs]
    for x, k in zip(xs, kept, strict=True):
        torch.testing.assert_close(f(x), model(k))
    if clone_input:
        # The capture owns its buffers: the caller's tensors are never written.
        for x, k in zip(xs, kept, strict=True):
            assert torch.equal(x, k)


class KVStep(torch.nn.Module):
    """One decode step writing its key into a cache in place (index_copy_), then attending."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, self.proj(x))
        return torch.softmax(x @ cache.T, dim=-1) @ cache


@torch.no_grad()
def test_kv_cache_updated_in_place_and_a_new_cache_is_recaptured(counter: Callable[[str], int]) -> None:
    model = KVStep()
    f = compiled(model)
    cache, ref_cache = torch.zeros(6, 4), torch.zeros(6, 4)
    for step in range(3):
        x, pos = torch.randn(1, 4), torch.tensor([step])
        torch.testing.assert_close(f(x, pos, cache), model(x, pos, ref_cache))
        torch.testing.assert_close(cache, ref_cache)
    assert counter("captured_") == 1

    old = cache.clone()
    new_cache = torch.randn(6, 4)
    new_ref = new_cache.clone()
    x, pos = torch.randn(1, 4), torch.tensor([4])
    torch.testing.assert_close(f(x, pos, new_cache), model(x, pos, new_ref))
    torch.testing.assert_close(new_cache, new_ref)
    assert torch.equal(cache, old), "the old cache must not be written by the new capture"
    assert counter("recapture_due_to_mutated_input_change_") == 1
    # Back on the old cache: still right.
    ref_old = old.clone()
    x = torch.randn(1, 4)
    torch.testing.assert_close(f(x, torch.tensor([5]), cache), model(x, torch.tensor([5]), ref_old))
    torch.testing.assert_close(cache, ref_old)


@pytest.mark.parametrize("frozen", [False, True])
@torch.no_grad()
def test_parameters_updated_in_place_are_seen_by_replay(frozen: bool) -> None:
    model = TwoLayer()
    f = compiled(model, frozen_parameter=frozen)
    x = torch.randn(2, 8)
    f(x)
    for _ in range(3):  # updated again before each replay
        model.a.weight.mul_(2)
        model.b.bias.add_(1)
        torch.testing.assert_close(f(x), model(x))
        x = torch.randn(2, 8)


@pytest.mark.parametrize("how", ["new_parameter", "data", "set_"])
@torch.no_grad()
def test_parameter_rebound_before_every_call_is_read_without_frozen_parameter(how: str) -> None:
    m = torch.nn.Linear(4, 3)
    c = compiled(m, frozen_parameter=False)
    for _ in range(4):
        x = torch.randn(2, 4)
        torch.testing.assert_close(c(x), m(x))
        new = torch.randn(3, 4)
        if how == "new_parameter":
            m.weight = torch.nn.Parameter(new)
        elif how == "data":
            m.weight.data = new
        else:
            m.weight.set_(new)


@torch.no_grad()
def test_rebound_parameter_is_honoured_without_frozen_parameter(counter: Callable[[str], int]) -> None:
    model = TwoLayer()
    f = compiled(model)
    x = torch.randn(2, 8)
    f(x)
    model.a.weight.data = torch.randn(8, 8)  # new storage, new address
    torch.testing.assert_close(f(x), model(x))
    assert counter("recapture_due_to_static_input_change_") == 1


@torch.no_grad()
def test_frozen_parameter_skips_the_address_check_of_parameters(counter: Callable[[str], int]) -> None:
    model = TwoLayer()
    f = compiled(model, frozen_parameter=True)
    x = torch.randn(2, 8)
    f(x)
    f(x)
    assert counter("recapture_due_to_static_input_change_") == 0
    assert counter("capture_due_to_new_key_") == 1


@torch.no_grad()
def test_force_eager_never_captures_and_counts_it(counter: Callable[[str], int]) -> None:
    model = TwoLayer()
    f = compiled(model, force_eager=True)
    for _ in range(2):
        x = torch.randn(2, 8)
        torch.testing.assert_close(f(x), model(x))
    assert counter("capture_due_to_new_key_") == 0
    assert counter("eager_fallback_due_to_force_eager_") >= 1
    assert not any(k.startswith("captured_") for k in _compat.counters())  # no counter at 0


@torch.no_grad()
def test_force_recapture_recaptures_every_call_and_counts_it(counter: Callable[[str], int]) -> None:
    model = TwoLayer()
    f = compiled(model, force_recapture=True)
    for _ in range(4):
        x = torch.randn(2, 8)
        torch.testing.assert_close(f(x), model(x))
    assert counter("recapture_due_to_force_recapture_") == 3


@torch.no_grad()
def test_dynamic_shapes_one_fx_graph_one_capture_per_key(counter: Callable[[str], int]) -> None:
    f = compiled(lambda x, y: (x @ y).relu(), dynamic=True)
    for n in (2, 3, 2, 3, 4):
        x, y = torch.randn(n, 5), torch.randn(5, 3)
        torch.testing.assert_close(f(x, y), (x @ y).relu())
    assert _compat.dynamo_counters()["stats"]["unique_graphs"] == 1
    assert counter("capture_due_to_new_key_") == 3
    assert counter("captured_") == 3


@pytest.mark.parametrize("reuse", [True, False])
@torch.no_grad()
def test_pool_choice_within_one_fx_graph_keeps_results_right(reuse: bool) -> None:
    f = compiled(lambda x: torch.tanh(x) * 3, dynamic=True, reuse_graph_pool_in_same_fx=reuse)
    outs = []
    xs = [torch.randn(n, 4) for n in (2, 3, 4)]
    for x in xs:
        outs.append(f(x).clone())
    for x, out in zip(xs, outs, strict=True):
        torch.testing.assert_close(out, torch.tanh(x) * 3)
        torch.testing.assert_close(f(x), torch.tanh(x) * 3)


@pytest.mark.parametrize("clone_output", [False, True])
@torch.no_grad()
def test_use_graph_pool_shared_by_two_compiled_functions(clone_output: bool) -> None:
    import npugraph_runtime

    pool = npugraph_runtime.graph_pool_handle("cpu")
    m1 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    c1 = compiled(m1, use_graph_pool=pool, clone_output=clone_output)
    c2 = compiled(m2, use_graph_pool=pool, clone_output=clone_output)
    kept = []
    for _ in range(3):
        x = torch.randn(2, 4)
        o1, o2 = c1(x), c2(x)
        torch.testing.assert_close(o1, m1(x))
        torch.testing.assert_close(o2, m2(x))
        kept.append((o1, m1(x), o2, m2(x)))
    for o1, w1, o2, w2 in kept:  # neither function's replays overwrote the other's outputs
        torch.testing.assert_close(o1, w1)
        torch.testing.assert_close(o2, w2)


@torch.no_grad()
def test_graph_with_rng_runs_eagerly_with_one_warning_never_frozen_numbers(counter: Callable[[str], int]) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand_like(x)

    g = compiled(f)
    x = torch.zeros(16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(1)
        first = g(x)
        second = g(x)
    torch.manual_seed(1)
    torch.testing.assert_close(first, f(x))
    torch.testing.assert_close(second, f(x))
    assert not torch.equal(first, second)
    rng = [w for w in caught if issubclass(w.category, EagerFallbackWarning)]
    assert len(rng) == 1 and "rand_like" in str(rng[0].message)
    assert "test_options.py" in str(rng[0].message), "the user's source line is named"
    assert counter("eager_fallback_due_to_unsafe_op_") == 1


def test_mode_is_ignored_with_one_warning() -> None:
    from npugraph_backend import ModeIgnoredWarning

    model = TwoLayer()
    f = torch.compile(model, backend="npugraph_ex", mode="reduce-overhead", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        x = torch.randn(2, 8)
        torch.testing.assert_close(f(x), model(x))
        f(x)
    assert len([w for w in caught if issubclass(w.category, ModeIgnoredWarning)]) == 1


def test_unknown_backend_keyword_is_refused() -> None:
    from npugraph_backend import OptionError, npugraph_ex_backend

    gm = torch.fx.symbolic_trace(TwoLayer())
    with pytest.raises(OptionError, match="bogus"):
        npugraph_ex_backend(gm, [torch.randn(2, 8)], bogus=1)


def test_invalid_options_are_refused_at_compile() -> None:
    f = compiled(lambda x: x + 1, capture_limit="64")
    with pytest.raises(Exception, match="capture_limit"):
        f(torch.randn(2))


def test_graph_needing_gradients_runs_eagerly_with_a_warning(counter: Callable[[str], int]) -> None:
    model = TwoLayer()
    f = compiled(model)
    x = torch.randn(2, 8)
    with pytest.warns(EagerFallbackWarning, match="no_grad"):
        out = f(x)
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    assert model.a.weight.grad is not None
    assert counter("capture_due_to_new_key_") == 0


@torch.no_grad()
def test_npu_only_options_warn_once_on_cpu_and_do_nothing() -> None:
    model = TwoLayer()
    f = compiled(model, static_kernel_compile=True, disable_static_kernel_compile_cache=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.randn(2, 8)
        torch.testing.assert_close(f(x), model(x))
        f(x)
    npu = [w for w in caught if issubclass(w.category, NpuOnlyOptionWarning)]
    assert len(npu) == 1 and "static_kernel_compile" in str(npu[0].message)


@torch.no_grad()
def test_options_do_not_leak_between_compiles(counter: Callable[[str], int]) -> None:
    model = TwoLayer()
    eager_f = compiled(model, force_eager=True)
    x = torch.randn(2, 8)
    eager_f(x)
    plain = torch.compile(TwoLayer(), backend="npugraph_ex", fullgraph=True, dynamic=False)
    plain(x)
    assert counter("capture_due_to_new_key_") == 1


@torch.no_grad()
def test_custom_passes_run_before_and_after_the_builtins_with_the_config() -> None:
    from npugraph_backend import CompilerConfig

    seen: list[tuple[str, bool]] = []

    def pre(gm: torch.fx.GraphModule, example_inputs: list[object], config: object) -> None:
        seen.append(("pre", isinstance(config, CompilerConfig)))

    def post(gm: torch.fx.GraphModule, example_inputs: list[object], config: object) -> None:
        seen.append(("post", isinstance(config, CompilerConfig)))
        # A rewrite the result must show: multiply the graph's output by 2.
        out = next(n for n in gm.graph.nodes if n.op == "output")
        (result,) = out.args[0]
        with gm.graph.inserting_before(out):
            doubled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (result, 2))
        out.args = ((doubled,),)
        gm.recompile()

    model = TwoLayer()
    f = compiled(model, post_grad_custom_pre_pass=pre, post_grad_custom_post_pass=post)
    x = torch.randn(2, 8)
    for _ in range(2):
        torch.testing.assert_close(f(x), model(x) * 2)
    assert seen == [("pre", True), ("post", True)]


@torch.no_grad()
def test_a_compiler_config_object_is_accepted_as_options_and_not_modified(
    counter: Callable[[str], int],
) -> None:
    from npugraph_backend import CompilerConfig

    config = CompilerConfig()
    config.force_recapture = True
    model = TwoLayer()
    f = torch.compile(model, backend="npugraph_ex", fullgraph=True, dynamic=False, options=config)
    for _ in range(3):
        x = torch.randn(2, 8)
        torch.testing.assert_close(f(x), model(x))
    assert counter("recapture_due_to_force_recapture_") == 2
    assert config == CompilerConfig(force_recapture=True)


class Accumulating(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.register_buffer("acc", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.acc.add_(x.mean(0))
        y = torch.relu(self.proj(x)) + self.acc
        return y, y[:2], self.acc


@pytest.mark.parametrize("options", [
    {"force_recapture": True}, {"capture_limit": 1}, {"reuse_graph_pool_in_same_fx": False},
    {"frozen_parameter": True, "clone_input": False, "clone_output": True},
])
def test_options_keep_replays_and_buffers_equal_to_eager(replays_match_eager: Callable[..., None], options: dict[str, Any],
                                                          counter: Callable[[str], int]) -> None:
    model = Accumulating().eval()
    compiled_model = copy.deepcopy(model)
    replays_match_eager(model, compiled(compiled_model, **options),
                        lambda i: (torch.randn(4, 16),))
    torch.testing.assert_close(compiled_model.acc, model.acc)
    assert counter("capture_due_to_new_key_") == 1
