"""An adversarial user's replays: several instances of one module class through one graph,
graph breaks in repeated layers, outputs held across calls, inputs that are views, threads, and
the options that change which memory a replay uses. Every output (and every mutated input) is
compared with eager over >= 6 calls with fresh inputs, and every output kept from an earlier call
is compared again after the later ones; a capture must have happened (counters)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from npugraph_backend import EagerFallbackWarning
from torch import nn

CALLS = 6


def _flat(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, list | tuple):
        return [t for o in out for t in _flat(o)]
    return []


@torch.no_grad()
def replays_match_eager(eager: Callable[..., object], compiled: Callable[..., object],
                        make: Callable[[int], Sequence[object]], calls: int = CALLS) -> None:
    """Each call's outputs and inputs equal eager's (given copies of the inputs); every output
    kept from an earlier call still equals eager's output of that call (a view of a buffer the
    later calls update changes in both)."""
    kept: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    for i in range(calls):
        args = make(i)
        eager_args = copy.deepcopy(args)
        want = _flat(eager(*eager_args))
        got = _flat(compiled(*args))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
        for g, w in zip(_flat(list(args)), _flat(list(eager_args)), strict=True):
            torch.testing.assert_close(g, w)  # inputs written by the graph, as eager wrote them
        kept.append((got, want))
        for outs, wants in kept:
            for g, w in zip(outs, wants, strict=True):
                torch.testing.assert_close(g, w)


def _compile(fn: Any, **options: Any) -> Any:
    return torch.compile(fn, backend="npugraph_ex", dynamic=False, options=options or None)


# ---- several instances of one module class through one graph --------------------------------
SHARED_NORM = nn.LayerNorm(16)


class SharedFirst(nn.Module):
    """Instances share the submodule their forward uses first."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = SHARED_NORM
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.proj(self.norm(x)))


class ClassTensorFirst(nn.Module):
    """Instances read a class-attribute tensor first (a static input they all share)."""

    table = torch.rand(16) + 0.5

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.table + torch.relu(self.proj(x))


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("cls", [SharedFirst, ClassTensorFirst])
def test_instances_sharing_their_first_static_input_replay_their_own_weights(
        cls: type[nn.Module], frozen: bool, counter: Callable[[str], int]) -> None:
    # frozen_parameter once checked only the first static input, which these instances share:
    # every layer replayed the first layer's capture
    layers = [cls().eval() for _ in range(3)]
    block = _compile(cls.forward, frozen_parameter=frozen)

    def run(f: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor], list[torch.Tensor]]:
        return lambda x: [f(layer, x) for layer in layers]

    replays_match_eager(run(cls.forward), run(block), lambda i: (torch.randn(4, 16),))
    assert counter("capture_due_to_new_key_") == 1
    assert counter("recapture_due_to_static_input_change_") >= 2


# ---- graph breaks inside repeated layers ---------------------------------------------------
class BreakingLayer(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.how = how

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        if self.how == "item":
            h = h * (1.0 if h.sum().item() > 0 else -1.0)
        elif self.how == "branch":
            h = h * 2 if h.mean() > 0.2 else h - 1
        else:
            print(end="")
        return self.b(h) + x, h


class BreakingStack(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BreakingLayer(how) for _ in range(3))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for layer in self.layers:
            x, h = layer(x)
            outs += [x, h]
        return outs


@pytest.mark.parametrize(("how", "options"), [
    ("print", {}), ("item", {"frozen_parameter": True}), ("branch", {"clone_output": True}),
    ("print", {"clone_input": False}), ("item", {"clone_input": False}),
])
def test_graph_broken_layers_keep_every_output(how: str, options: dict[str, Any],
                                               counter: Callable[[str], int]) -> None:
    # each layer's graphs feed the next ones; every layer's results are kept. Under
    # clone_input=False the second graph once adopted the first graph's result as its input
    # buffer, and the next call's refill overwrote the kept result
    model = BreakingStack(how).eval()
    replays_match_eager(model, _compile(model, **options), lambda i: (torch.randn(4, 16),))
    assert counter("capture_due_to_new_key_") >= 2


@pytest.mark.parametrize("clone_output", [False, True])
def test_instances_with_a_graph_break_keep_outputs_under_clone_input_false(
        clone_output: bool, counter: Callable[[str], int]) -> None:
    # the second instance's capture of the graph after the break adopted that call's input (the
    # first graph's result, a clone under clone_output) as its buffer: the next call's refill
    # overwrote a result the caller kept
    layers = [BreakingLayer("print").eval() for _ in range(3)]
    layer_forward = _compile(BreakingLayer.forward, clone_input=False, clone_output=clone_output)

    def run(f: Callable[..., tuple[torch.Tensor, torch.Tensor]]
            ) -> Callable[[torch.Tensor], list[torch.Tensor]]:
        return lambda x: [t for layer in layers for t in f(layer, x)]

    replays_match_eager(run(BreakingLayer.forward), run(layer_forward),
                        lambda i: (torch.randn(4, 16),))
    assert counter("recapture_due_to_static_input_change_") >= 2


# ---- outputs kept across calls ---------------------------------------------------------------
W = torch.randn(16, 16)


def views_and_repeats(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    y = torch.relu(x @ W)
    return x[1:], x.t(), y, y, y[:, :4], y.t()  # views of the input, of each other, twice


def decode_step(tok: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    cache.index_copy_(0, pos, tok)
    return torch.softmax(cache @ W, -1).sum(0, keepdim=True), cache[:2]


@pytest.mark.parametrize("options", [{}, {"clone_output": True}, {"frozen_parameter": True}])
def test_outputs_viewing_inputs_and_each_other_are_kept(options: dict[str, Any],
                                                        counter: Callable[[str], int]) -> None:
    replays_match_eager(views_and_repeats, _compile(views_and_repeats, **options),
                        lambda i: (torch.randn(4, 16),))
    assert counter("capture_due_to_new_key_") == 1


@pytest.mark.parametrize("options", [{}, {"clone_output": True}])
@torch.no_grad()
def test_decode_loop_feeds_outputs_back_and_keeps_them_all(options: dict[str, Any],
                                                           counter: Callable[[str], int]) -> None:
    step = _compile(decode_step, **options)
    cache, want_cache = torch.zeros(8, 16), torch.zeros(8, 16)
    tok = want_tok = torch.randn(1, 16)
    kept = []
    for i in range(8):
        pos = torch.tensor([i])
        got, want = step(tok, cache, pos), decode_step(want_tok, want_cache, pos)
        torch.testing.assert_close(cache, want_cache)
        kept.append((got, want))
        for g, w in kept:
            torch.testing.assert_close(g, w)
        (tok, _), (want_tok, _) = got, want
    assert counter("capture_due_to_new_key_") == 1


# ---- inputs that are views -----------------------------------------------------------------
def read_two(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return a @ W + b.sum(), a * 2, b + 1


def _views(base: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    if how == "overlapping":
        return base[0:8], base[4:12]
    if how == "transposed":
        return base[:, :8].t(), base[:8, 8:].t()
    if how == "expanded":
        return base[0:1].expand(8, 16), base[1].expand(8, 16)
    if how == "offset":
        return base.view(-1)[7:135].view(8, 16), base[3:11]
    return base[:8], base[:8]  # the same tensor twice


@pytest.mark.parametrize("clone_input", [True, False])
@pytest.mark.parametrize("how", ["overlapping", "transposed", "expanded", "offset", "same"])
def test_view_inputs_match_eager(how: str, clone_input: bool, counter: Callable[[str], int]) -> None:
    replays_match_eager(read_two, _compile(read_two, clone_input=clone_input),
                        lambda i: _views(torch.randn(16, 16), how))
    assert counter("capture_due_to_new_key_") == 1


def write_into_views(buf: torch.Tensor, cache: torch.Tensor, idx: torch.Tensor,
                     x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    buf[:, 2:6].copy_(x[:, :4])
    cache.index_copy_(0, idx, x[:2])
    return buf.sum(1), cache * 2


@pytest.mark.parametrize("clone_input", [True, False])
def test_graph_writes_into_offset_views_of_inputs(clone_input: bool,
                                                  counter: Callable[[str], int]) -> None:
    def make(i: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(12, 16)[2:10], torch.randn(20, 16)[3:13],
                torch.tensor([i % 10, (i + 3) % 10]), torch.randn(8, 16))

    replays_match_eager(write_into_views, _compile(write_into_views, clone_input=clone_input),
                        make)
    assert counter("capture_due_to_new_key_") == 1


# ---- threads and options ---------------------------------------------------------------------
class Accumulating(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.register_buffer("acc", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.acc.add_(x.mean(0))
        y = torch.relu(self.proj(x)) + self.acc
        return y, y[:2], self.acc


@pytest.mark.parametrize("options", [
    {"force_recapture": True}, {"capture_limit": 1}, {"reuse_graph_pool_in_same_fx": False},
    {"frozen_parameter": True, "clone_input": False, "clone_output": True},
])
def test_options_keep_replays_and_buffers_equal_to_eager(options: dict[str, Any],
                                                          counter: Callable[[str], int]) -> None:
    model = Accumulating().eval()
    compiled_model = copy.deepcopy(model)
    replays_match_eager(model, _compile(compiled_model, **options),
                        lambda i: (torch.randn(4, 16),))
    torch.testing.assert_close(compiled_model.acc, model.acc)
    assert counter("capture_due_to_new_key_") == 1


def test_threads_keep_their_outputs(counter: Callable[[str], int]) -> None:
    model = BreakingStack("print").eval()
    compiled = _compile(model)
    compiled(torch.randn(4, 16))
    failures: list[BaseException] = []

    def work(seed: int) -> None:
        torch.manual_seed(seed)
        try:
            replays_match_eager(model, compiled, lambda i: (torch.randn(4, 16),))
        except BaseException as e:  # reported by the main thread
            failures.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[0]
    assert counter("capture_due_to_new_key_") >= 2


# ---- higher-order operators ------------------------------------------------------------------
@torch.compiler.nested_compile_region
def _region(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ W)


def twice_through_a_region(x: torch.Tensor) -> torch.Tensor:
    return _region(_region(x)) + 1


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v)  # type: ignore[no-any-return]


def running_sum(x: torch.Tensor) -> torch.Tensor:
    from torch._higher_order_ops import scan

    return scan(lambda c, xs: (c + xs, c * 2), torch.zeros(16), x)[1]  # type: ignore[no-any-return]


def shape_branch(x: torch.Tensor) -> torch.Tensor:
    return torch.cond(x.shape[0] > 4, lambda t: t @ W, lambda t: t * -3.0, (x,))


@pytest.mark.parametrize(("fn", "shapes", "dynamic"), [
    (twice_through_a_region, [(4, 16)], False),
    (flex, [(1, 2, 8, 16)] * 3, False),
    (running_sum, [(4, 16)], False),
    (shape_branch, [(3, 16), (5, 16)], True),
])
def test_higher_order_operators_are_captured(fn: Callable[..., torch.Tensor],
                                             shapes: list[tuple[int, ...]], dynamic: bool,
                                             counter: Callable[[str], int]) -> None:
    # the CPU graph's recorder once refused every higher-order operator with a NotImplementedError
    # (eager works); it now records the ATen ops of their bodies
    compiled = torch.compile(fn, backend="npugraph_ex", dynamic=dynamic)
    if dynamic:  # one argument whose batch alternates between the two shapes
        make = lambda i: (torch.randn(*shapes[i % 2]),)  # noqa: E731
    else:
        make = lambda i: tuple(torch.randn(*s) for s in shapes)  # noqa: E731
    replays_match_eager(fn, compiled, make)
    assert counter("capture_due_to_new_key_") >= 1
    assert counter("eager_fallback_") == 0


def tensor_branch(x: torch.Tensor) -> torch.Tensor:
    return torch.cond(x.sum() > 0, lambda t: t @ W, lambda t: t * -3.0, (x,))


def grow_until(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from torch._higher_order_ops import while_loop

    return while_loop(lambda i, t: t.abs().sum() < 100, lambda i, t: (i + 1, t * 1.5),  # type: ignore[no-any-return]
                      (torch.tensor(0), x))


@pytest.mark.parametrize("fn", [tensor_branch, grow_until])
def test_data_dependent_control_flow_runs_eagerly_with_a_reason(
        fn: Callable[..., object], counter: Callable[[str], int]) -> None:
    # a capture would repeat the captured branch (or crash reading the predicate back)
    compiled = torch.compile(fn, backend="npugraph_ex")
    with pytest.warns(EagerFallbackWarning, match="data-dependent control flow"):
        replays_match_eager(fn, compiled, lambda i: ((1 if i % 2 else -1) * torch.rand(4, 16),))
    assert counter("eager_fallback_due_to_unsafe_op_") == 1
    assert counter("captured_") == 0
