"""A functional fn (the backend's traced graph) on the CPU: a new key's capture is the call's run,
so the first call runs fn once, its writes to mutated inputs land once and its result is the
eager one. Every result is compared with eager over >= 5 calls with fresh inputs."""

from __future__ import annotations

from collections.abc import Callable

import npugraph_runtime as ngr
import pytest
import torch
from npugraph_runtime.spec import CapturePolicy, InputSpec


def graphed(body: Callable[..., object], example: tuple[object, ...], mutated: tuple[int, ...] = (),
            **policy: object) -> tuple[ngr.GraphedCallable, list[int]]:
    runs: list[int] = []

    def fn(*args: object) -> object:
        runs.append(1)
        return body(*args)

    spec = InputSpec.infer(example, (), mutated)
    return ngr.GraphedCallable(fn, spec, CapturePolicy(**policy), functional=True), runs  # type: ignore[arg-type]


def _counter(x: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    steps.add_(1)
    return x * steps


@pytest.mark.parametrize("warmup", [1, 3])
@torch.no_grad()
def test_counter_buffer_is_written_once_and_the_first_call_runs_fn_once(warmup: int) -> None:
    steps, eager_steps = torch.zeros(1), torch.zeros(1)
    g, runs = graphed(_counter, (torch.randn(4), steps), (1,), warmup=warmup)
    for i in range(6):
        x = torch.randn(4)
        torch.testing.assert_close(g(x, steps), _counter(x, eager_steps), rtol=0, atol=0)
        torch.testing.assert_close(steps, eager_steps, rtol=0, atol=0)
        if i == 0:
            assert len(runs) == warmup  # the undone warmups, then the capture: no eager run
    assert len(runs) == warmup
    assert [e.reason for e in g.events] == ["new_key"]


def _kv_write(x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(0, pos, x)
    return cache.sum(0) * 2


@torch.no_grad()
def test_kv_cache_index_copy_lands_once() -> None:
    cache, eager_cache = torch.zeros(8, 3), torch.zeros(8, 3)
    g, runs = graphed(_kv_write, (torch.randn(1, 3), torch.tensor([0]), cache), (2,))
    for i in range(6):
        x, pos = torch.randn(1, 3), torch.tensor([i])
        torch.testing.assert_close(g(x, pos, cache), _kv_write(x, pos, eager_cache), rtol=0, atol=0)
        torch.testing.assert_close(cache, eager_cache, rtol=0, atol=0)
    assert len(runs) == 1
    assert g.num_captures == 1


@torch.no_grad()
def test_a_held_first_output_is_the_callers_own() -> None:
    g, runs = graphed(lambda x: (x * 2 + 1, x.sum()), (torch.randn(4),))
    x0 = torch.randn(4)
    first = g(x0)
    assert len(runs) == 1
    kept = [first]
    for _ in range(5):
        x = torch.randn(4)
        out = g(x)
        torch.testing.assert_close(out, (x * 2 + 1, x.sum()))
        del out
    # the first result is no static output: holding it made no capture, and no replay changed it
    assert g.num_captures == 1
    torch.testing.assert_close(kept[0], (x0 * 2 + 1, x0.sum()), rtol=0, atol=0)


def _strided_count(x: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    steps.add_(1)
    return torch.as_strided(x, (3,), (1,), 2) * steps


@torch.no_grad()
def test_as_strided_read_recaptures_without_writing_twice() -> None:
    steps, eager_steps = torch.zeros(1), torch.zeros(1)
    g, runs = graphed(_strided_count, (torch.randn(6)[1:], steps), (1,))
    for _ in range(6):
        x = torch.randn(6)[1:]
        torch.testing.assert_close(g(x, steps), _strided_count(x, eager_steps), rtol=0, atol=0)
        torch.testing.assert_close(steps, eager_steps, rtol=0, atol=0)
    assert len(runs) == 2  # captured once with dense buffers, again with mirrored ones
    assert g.num_captures == 1


@torch.no_grad()
def test_a_write_to_another_tensor_stays_and_the_capture_is_the_call() -> None:
    # It used to be undone and the call run again eagerly: fn ran twice in one call, and so did
    # its collectives (test_collectives_once.py)
    hidden, eager_hidden = torch.zeros(2), torch.zeros(2)

    def body(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h.add_(1)  # not an input: fn is not what functional=True promises
        return x + h

    g, runs = graphed(lambda x: body(x, hidden), (torch.randn(2),))
    for i in range(6):
        x = torch.randn(2)
        torch.testing.assert_close(g(x), body(x, eager_hidden), rtol=0, atol=0)
        torch.testing.assert_close(hidden, eager_hidden, rtol=0, atol=0)
        if i == 0:
            assert len(runs) == 1  # the capture, and no eager run after it
    assert len(runs) == 1
    assert g.num_captures == 1


@torch.no_grad()
def test_extra_warmup_runs_leave_no_write_behind() -> None:
    # undone warm-up runs used to restore the mutated inputs only: a tensor fn writes besides
    # them (its state, here through a view) was written once per warm-up run
    state, eager_state = torch.zeros(4), torch.zeros(4)

    def body(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        s.view(2, 2).add_(1)
        s[1:].mul_(2)
        return x + s

    g = ngr.make_graphed_callable(lambda x: body(x, state), (torch.randn(4),), warmup=3)
    for _ in range(6):
        x = torch.randn(4)
        torch.testing.assert_close(g(x), body(x, eager_state), rtol=0, atol=0)
        torch.testing.assert_close(state, eager_state, rtol=0, atol=0)
    assert g.num_captures >= 1 and g.events[0].reason == "new_key"


@torch.no_grad()
def test_not_functional_keeps_the_eager_warmup() -> None:
    runs: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        runs.append(1)
        return x * 2

    g = ngr.make_graphed_callable(fn, (torch.randn(3),))
    g(torch.randn(3))
    assert len(runs) == 2  # warmup (the call's result) + capture


def test_functional_must_be_a_bool() -> None:
    spec = InputSpec.infer((torch.randn(4),), (), ())
    with pytest.raises(ngr.PolicyError, match=r"functional must be True or False, got 'yes'"):
        ngr.GraphedCallable(torch.neg, spec, CapturePolicy(), functional="yes")  # type: ignore[arg-type]
