"""GraphedCallable.bind: a call that passes only the leading inputs, the static ones held by the
binding (the cache's serving plan holds a model's parameters so). Every result is compared with
eager over >= 5 calls with fresh inputs; each test fails if the check it covers is removed from
the bound replay closure."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import npugraph_runtime as ngr
import pytest
import torch
import torch.nn.functional as F
from npugraph_runtime._compat import npugraph_ex_counters
from npugraph_runtime.spec import CapturePolicy, InputSpec, SlotKind

Fn = Callable[[tuple[object, ...]], object]


def mlp(x: torch.Tensor, y: torch.Tensor, *params: torch.Tensor) -> tuple[torch.Tensor]:
    h = x * y
    for w, b in zip(params[::2], params[1::2], strict=True):
        h = torch.relu(F.linear(h, w, b))
    return (h,)


@pytest.fixture
def params() -> list[torch.Tensor]:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(3)]
    return [p.detach().requires_grad_(False) for layer in layers for p in layer.parameters()]


@pytest.fixture(autouse=True)
def no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


def _graphed(params: list[torch.Tensor], **policy: object) -> ngr.GraphedCallable:
    spec = InputSpec((SlotKind.USER, SlotKind.USER) + (SlotKind.STATIC,) * len(params),
                     ((), ()) + ((),) * len(params))
    return ngr.GraphedCallable(mlp, spec, CapturePolicy(**policy), functional=True)  # type: ignore[arg-type]


def _bound(fn: ngr.GraphedCallable, params: list[torch.Tensor]) -> Fn:
    bound = fn.bind(params)
    assert bound is not None
    return bound


def _inputs(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(n)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(n)]


def _same(bound: Fn, params: list[torch.Tensor], calls: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for call in calls:
        torch.testing.assert_close(bound(call), mlp(*call, *params))


class _GeneralCalls:
    """Counts the calls that left the bound path for GraphedCallable.__call__."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        general = ngr.GraphedCallable.__call__

        def counted(fn: ngr.GraphedCallable, *args: object) -> object:
            self.count += 1
            return general(fn, *args)

        monkeypatch.setattr(ngr.GraphedCallable, "__call__", counted)


def test_a_bound_call_replays_without_the_general_path(
    params: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    fn = _graphed(params, name="bound")
    bound = _bound(fn, params)
    general = _GeneralCalls(monkeypatch)
    _same(bound, params, _inputs(6))
    assert fn.num_captures == 1
    assert general.count == 1  # the capturing call; its bound closure is made right after
    assert npugraph_ex_counters()["captured_bound"] == 1


def test_a_data_swap_of_a_held_parameter_is_a_new_capture(params: list[torch.Tensor]) -> None:
    """Every held input's address is checked (not only the first): the last bias changes
    storage, the bound call replays a capture with the new values."""
    fn = _graphed(params)
    bound = _bound(fn, params)
    _same(bound, params, _inputs(5))
    params[-1].data = torch.randn(16)
    _same(bound, params, _inputs(5))
    assert fn.num_captures == 2
    params[0].data = torch.randn(16, 16)
    _same(bound, params, _inputs(5))
    assert fn.num_captures == 3


def test_frozen_static_inputs_check_the_first_held_address_only(params: list[torch.Tensor]) -> None:
    fn = _graphed(params, check_static_addresses=False)
    bound = _bound(fn, params)
    _same(bound, params, _inputs(5))
    params[0].data = torch.randn(16, 16)
    _same(bound, params, _inputs(5))
    assert fn.num_captures == 2


def test_outputs_held_from_a_bound_call_keep_their_values(params: list[torch.Tensor]) -> None:
    fn = _graphed(params)
    bound = _bound(fn, params)
    calls = _inputs(7)
    _same(bound, params, calls[:1])  # the capture's own run: its result is the caller's
    kept = bound(calls[1])
    expected = mlp(*calls[1], *params)[0].clone()
    _same(bound, params, calls[2:])
    torch.testing.assert_close(kept[0], expected)  # type: ignore[index]
    assert [e.reason for e in fn.events] == ["new_key", "held_outputs"]


def test_two_threads_on_one_bound_call_each_get_their_own_result(params: list[torch.Tensor]) -> None:
    """A result stays intact while the other thread's calls run (held outputs move a call to
    another capture); one call at a time (the lock)."""
    fn = _graphed(params, capture_limit=8)
    bound = _bound(fn, params)
    errors: list[BaseException] = []

    def serve(seed: int) -> None:
        try:
            with torch.no_grad():
                for call in _inputs(30 + seed):
                    got = bound(call)
                    expected = mlp(*call, *params)  # while the other thread replays
                    torch.testing.assert_close(got, expected)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    assert not fn.fell_back and fn.num_captures <= 3


def test_reset_drops_the_bound_closures_and_the_next_call_captures_again(
    params: list[torch.Tensor],
) -> None:
    fn = _graphed(params)
    bound = _bound(fn, params)
    _same(bound, params, _inputs(3))
    variants = list(fn._bound)
    assert [len(v.by_run) for v in variants] == [1]
    fn.reset()
    assert [len(v.by_run) for v in variants] == [0]  # nothing keeps the released capture alive
    _same(bound, params, _inputs(5))
    assert fn.num_captures == 1 and len(fn.events) == 2


def test_a_bound_call_of_a_fallen_back_callable_runs_eagerly(params: list[torch.Tensor]) -> None:
    fn = _graphed(params, force_eager=True)
    bound = _bound(fn, params)
    _same(bound, params, _inputs(5))
    assert fn.fell_back and fn.num_captures == 0


def test_bind_refuses_a_held_input_that_is_not_static(params: list[torch.Tensor]) -> None:
    fn = _graphed(params)
    y = torch.randn(8, 16)
    assert fn.bind([y, *params]) is None  # input 1 is a user input: copied every call
    assert fn.bind([]) is None
    bound = _bound(fn, params)
    with pytest.raises(ngr.PolicyError, match="called with 7 arguments"):
        bound((torch.randn(8, 16),))


def test_a_bound_call_whose_every_capture_is_held_runs_eagerly(params: list[torch.Tensor]) -> None:
    """At capture_limit, with the outputs of every capture of the key still referenced, a bound
    call runs eagerly (the general path's rule) and nothing kept is overwritten."""
    fn = _graphed(params, capture_limit=2)
    bound = _bound(fn, params)
    calls = _inputs(6)
    _same(bound, params, calls[:1])
    # on the CPU a capture is its call's run and returns clones: calls 1 and 3 replay the two
    # captures into their outputs, kept; call 4 finds both held
    kept = [bound(c) for c in calls[1:4]]
    with pytest.warns(UserWarning, match="runs eagerly instead of overwriting"):
        kept.append(bound(calls[4]))
    expected = [mlp(*c, *params)[0] for c in calls[1:5]]
    _same(bound, params, calls[5:])
    for got, want in zip(kept, expected, strict=True):
        torch.testing.assert_close(got[0], want)  # type: ignore[index]
    assert fn.num_captures == 2 and not fn.fell_back
    assert npugraph_ex_counters()[f"eager_call_due_to_held_outputs_{fn.name}"] >= 1
