"""A replay never returns or leaves behind a wrong value: outputs the caller still holds,
one graph serving several parameter sets, inputs read through as_strided, threads, keys."""

from __future__ import annotations

import threading
import warnings

import npugraph_runtime as ngr
import pytest
import torch
from npugraph_runtime._compat import npugraph_ex_counters


def counters() -> dict[str, int]:
    return dict(npugraph_ex_counters())


def linear_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.relu(torch.nn.functional.linear(x, w, b))


def graphed(name: str, device: str = "cpu", **policies: object) -> tuple[ngr.GraphedCallable, torch.nn.Linear]:
    layer = torch.nn.Linear(16, 8, device=device)
    fn = ngr.make_graphed_callable(linear_relu, (torch.randn(4, 16, device=device), layer.weight,
                                                 layer.bias),
                                   static_argnums=(1, 2), name=name, **policies)
    return fn, layer


# ---- 1. outputs still held ------------------------------------------------------------------
@torch.no_grad()
def test_kept_outputs_keep_their_values_over_later_calls(device: str) -> None:
    fn, layer = graphed("kept", device)
    xs = [torch.randn(4, 16, device=device) for _ in range(6)]
    kept = [fn(x, layer.weight, layer.bias) for x in xs]  # every result held at once
    for x, out in zip(xs, kept, strict=True):
        torch.testing.assert_close(out, linear_relu(x, layer.weight, layer.bias))
    if device == "cpu":
        # a capture there computes: a held-outputs capture's own call returns clones of its
        # run, so the next call replays it (its collectives must run once a call)
        assert counters()["capture_due_to_held_outputs_kept"] == (len(xs) - 1) // 2
        assert fn.num_captures == 1 + (len(xs) - 1) // 2
    else:
        assert counters()["capture_due_to_held_outputs_kept"] == len(xs) - 2  # call 1 is warmup's
        assert fn.num_captures == len(xs) - 1


@torch.no_grad()
def test_a_view_of_an_output_keeps_its_values() -> None:
    fn, layer = graphed("viewed")
    fn(torch.randn(4, 16), layer.weight, layer.bias)
    x1 = torch.randn(4, 16)
    row = fn(x1, layer.weight, layer.bias)[1:]  # only a view survives: the storage is held
    for _ in range(5):
        x = torch.randn(4, 16)
        torch.testing.assert_close(fn(x, layer.weight, layer.bias), linear_relu(x, layer.weight, layer.bias))
    torch.testing.assert_close(row, linear_relu(x1, layer.weight, layer.bias)[1:])


@torch.no_grad()
def test_decode_loop_alternates_between_two_captures() -> None:
    emb = torch.randn(32, 16)
    head = torch.randn(32, 16)

    def step(tok: torch.Tensor, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(tok, e) @ h.T

    fn = ngr.make_graphed_callable(step, (torch.zeros(1, 1, dtype=torch.long), emb, head),
                                   static_argnums=(1, 2), name="decode")
    tok = torch.zeros(1, 1, dtype=torch.long)
    ref = tok.clone()
    for _ in range(12):
        logits = fn(tok, emb, head)  # the previous logits are still referenced here
        tok = logits[:, -1:].argmax(-1)
        expected = step(ref, emb, head)
        torch.testing.assert_close(logits, expected)
        ref = expected[:, -1:].argmax(-1)
    assert [e.reason for e in fn.events] == ["new_key", "held_outputs"]
    assert fn.num_captures == 2


@torch.no_grad()
def test_held_outputs_at_the_capture_limit_run_eagerly_with_one_warning() -> None:
    fn, layer = graphed("held_limit", capture_limit=1)
    fn(torch.randn(4, 16), layer.weight, layer.bias)
    xs = [torch.randn(4, 16) for _ in range(5)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = [fn(x, layer.weight, layer.bias) for x in xs]
    for x, out in zip(xs, kept, strict=True):
        torch.testing.assert_close(out, linear_relu(x, layer.weight, layer.bias))
    assert counters()["eager_call_due_to_held_outputs_held_limit"] == len(xs) - 1
    assert len(caught) == 1 and "clone_output=True" in str(caught[0].message)
    assert caught[0].filename == __file__  # points at the user's call
    assert fn.num_captures == 1 and not fn.fell_back


@torch.no_grad()
def test_clone_output_needs_no_second_capture() -> None:
    fn, layer = graphed("cloned", clone_output=True)
    xs = [torch.randn(4, 16) for _ in range(6)]
    kept = [fn(x, layer.weight, layer.bias) for x in xs]
    for x, out in zip(xs, kept, strict=True):
        torch.testing.assert_close(out, linear_relu(x, layer.weight, layer.bias))
    assert fn.num_captures == 1


# ---- 2. several parameter sets through one graph ----------------------------------------------
@pytest.mark.parametrize("check", [True, False])
@torch.no_grad()
def test_alternating_parameter_sets_replay_their_own_captures(check: bool) -> None:
    layers = [torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)]
    name = f"instances_{check}"
    fn = ngr.make_graphed_callable(linear_relu, (torch.randn(4, 16), layers[0].weight, layers[0].bias),
                                   static_argnums=(1, 2), check_static_addresses=check, name=name)
    for call in range(10):
        layer = layers[call % 2]
        x = torch.randn(4, 16)
        torch.testing.assert_close(fn(x, layer.weight, layer.bias), linear_relu(x, layer.weight, layer.bias))
    assert [e.reason for e in fn.events] == ["new_key", "static_input_change"]  # no recapture per call
    assert fn.num_captures == 2


# ---- 4. inputs read through as_strided -------------------------------------------------------
def strided_from_offset(x: torch.Tensor) -> torch.Tensor:
    return torch.as_strided(x, (3,), (1,), 2) * 2


def strided_over_a_gap(x: torch.Tensor) -> torch.Tensor:
    return x.as_strided((2, 3), (1, 2)) + 1


@pytest.mark.parametrize("clone_input", [True, False])
@pytest.mark.parametrize(("fn", "make"), [
    (strided_from_offset, lambda d: torch.randn(6, device=d)[1:]),
    (strided_over_a_gap, lambda d: torch.randn(2, 6, device=d)[:, ::2]),
])
@torch.no_grad()
def test_as_strided_reads_of_view_inputs_match_eager(fn, make, clone_input: bool, device: str) -> None:  # type: ignore[no-untyped-def]
    g = ngr.make_graphed_callable(fn, (make(device),), clone_input=clone_input)
    for _ in range(6):
        x = make(device)
        torch.testing.assert_close(g(x), fn(x))
    assert g.num_captures == 1


@torch.no_grad()
def test_as_strided_input_with_another_layout_is_refused() -> None:
    g = ngr.make_graphed_callable(strided_from_offset, (torch.randn(6)[1:],))
    g(torch.randn(6)[1:])
    with pytest.raises(ngr.PolicyError, match="as_strided"):
        g(torch.randn(7)[2:])


# ---- 5. threads ------------------------------------------------------------------------------
@pytest.mark.parametrize("clone_output", [False, True])
def test_threads_hammering_one_callable_get_their_own_results(clone_output: bool) -> None:
    fn, layer = graphed(f"threads_{clone_output}", clone_output=clone_output)
    wrong: list[int] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with torch.no_grad():
                for _ in range(150):
                    x = torch.randn(4, 16)
                    out = fn(x, layer.weight, layer.bias)
                    if not torch.allclose(out, linear_relu(x, layer.weight, layer.bias)):
                        wrong.append(1)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not wrong
    assert 1 <= fn.num_captures <= 5  # one per result a thread can hold at once, at most


# ---- 6. keys ---------------------------------------------------------------------------------
@torch.no_grad()
def test_dtype_is_part_of_the_hand_written_key() -> None:
    g = ngr.make_graphed_callable(lambda x: x * 3, (torch.randn(4),))
    for dtype in (torch.float32, torch.float64, torch.complex64, torch.float32, torch.complex64):
        x = torch.randn(4, dtype=dtype)
        out = g(x)
        assert out.dtype == dtype
        torch.testing.assert_close(out, x * 3)
    assert g.num_captures == 3


@torch.no_grad()
def test_int_float_and_bool_scalars_select_their_own_graphs() -> None:
    def scale(x: torch.Tensor, s: object) -> torch.Tensor:
        return torch.arange(4) * s + x.sum().to(torch.long) * 0

    g = ngr.make_graphed_callable(scale, (torch.randn(4), 2))
    for s in (2, 2.0, True, 2, 2.0, True):
        out = g(torch.randn(4), s)
        expected = scale(torch.randn(4), s)
        assert out.dtype == expected.dtype
        torch.testing.assert_close(out, expected)
    assert g.num_captures == 3


# ---- also: warnings point at the user's call -------------------------------------------------
@torch.no_grad()
def test_capture_limit_warning_points_at_the_callers_line() -> None:
    fn, layer = graphed("warn_line", capture_limit=1)
    fn(torch.randn(4, 16), layer.weight, layer.bias)
    with pytest.warns(UserWarning, match="capture_limit=1") as caught:
        fn(torch.randn(2, 16), layer.weight, layer.bias)
    assert caught[0].filename == __file__
