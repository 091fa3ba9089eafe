"""The npugraph_ex marker ops: eager scope stack, tracing, and their place in AOT graphs."""

from __future__ import annotations

import threading

import npugraph_runtime as ngr
import pytest
import torch
from npugraph_runtime import ops
from npugraph_runtime.errors import NpugraphError
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode

npugraph_ex = torch.ops.npugraph_ex


def test_importing_the_runtime_registers_the_four_ops() -> None:
    for name in ("scope_enter", "scope_exit", "record", "wait"):
        assert hasattr(npugraph_ex, name)
    ops.register()  # idempotent


def test_scope_enter_and_exit_push_and_pop_the_scope() -> None:
    assert ngr.current_scope() == {}
    npugraph_ex.scope_enter(["a", "b"], ["1", "2"])
    try:
        assert ngr.current_scope() == {"a": "1", "b": "2"}
    finally:
        npugraph_ex.scope_exit()
    assert ngr.current_scope() == {}


def test_inner_scope_overrides_outer_keys_until_it_exits() -> None:
    npugraph_ex.scope_enter(["a", "b"], ["1", "2"])
    npugraph_ex.scope_enter(["a"], ["9"])
    assert ngr.current_scope() == {"a": "9", "b": "2"}
    assert ops.scope_stack() == ({"a": "1", "b": "2"}, {"a": "9"})
    npugraph_ex.scope_exit()
    assert ngr.current_scope() == {"a": "1", "b": "2"}
    npugraph_ex.scope_exit()


def test_scope_exit_without_enter_is_an_error() -> None:
    with pytest.raises(NpugraphError, match="scope_exit"):
        npugraph_ex.scope_exit()


def test_scope_keys_and_values_must_pair_up() -> None:
    with pytest.raises(NpugraphError, match="2 keys and 1 values"):
        npugraph_ex.scope_enter(["a", "b"], ["1"])
    assert ngr.current_scope() == {}


def test_scope_stack_is_per_thread() -> None:
    seen: list[dict[str, str]] = []
    npugraph_ex.scope_enter([ops.USER_STREAM_LABEL], ["side"])
    try:
        t = threading.Thread(target=lambda: seen.append(ngr.current_scope()))
        t.start()
        t.join()
        assert ngr.current_scope() == {ops.USER_STREAM_LABEL: "side"}
    finally:
        npugraph_ex.scope_exit()
    assert seen == [{}]


def test_record_returns_a_small_token_and_wait_accepts_it() -> None:
    token = npugraph_ex.record()
    assert isinstance(token, torch.Tensor) and token.numel() == 1
    assert npugraph_ex.wait([token, npugraph_ex.record()]) is None


def test_fake_kernels_trace_without_touching_the_scope_stack() -> None:
    with FakeTensorMode():
        npugraph_ex.scope_enter(["a"], ["1"])
        token = npugraph_ex.record()
        npugraph_ex.wait([token])
        assert ngr.current_scope() == {}
        npugraph_ex.scope_exit()
    assert token.shape == (1,) and token.dtype == torch.int8


def test_dead_code_elimination_keeps_the_ops() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(npugraph_ex.scope_enter.default, (["a"], ["1"]))
    graph.call_function(npugraph_ex.scope_exit.default, ())
    token = graph.call_function(npugraph_ex.record.default, ())
    graph.call_function(npugraph_ex.wait.default, ([token],))
    graph.call_function(torch.ops.aten.relu.default, (x,))  # unused: removed
    graph.output(x)
    graph.eliminate_dead_code()
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets == [npugraph_ex.scope_enter.default, npugraph_ex.scope_exit.default,
                       npugraph_ex.record.default, npugraph_ex.wait.default]


def _aot_graph(fn, *args):  # type: ignore[no-untyped-def]
    graphs: list[torch.fx.GraphModule] = []

    def fw(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        graphs.append(gm)
        return gm.forward

    out = torch.compile(fn, backend=aot_autograd(fw_compiler=fw), fullgraph=True)(*args)
    return out, graphs[0]


def test_aot_keeps_the_ops_in_program_order_and_results_equal_eager() -> None:
    weight = torch.randn(16, 16)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x @ weight
        npugraph_ex.scope_enter([ops.USER_STREAM_LABEL], ["side"])
        g = h.relu()
        token = npugraph_ex.record()
        npugraph_ex.scope_exit()
        npugraph_ex.wait([token])
        return g + h

    x = torch.randn(4, 16)
    out, gm = _aot_graph(fn, x)
    torch.testing.assert_close(out, fn(x))
    order = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    mine = [t for t in order if getattr(t, "namespace", None) == "npugraph_ex"]
    assert mine == [npugraph_ex.scope_enter.default, npugraph_ex.record.default,
                    npugraph_ex.scope_exit.default, npugraph_ex.wait.default]
    # The scope still encloses the relu it was written around.
    assert order.index(npugraph_ex.scope_enter.default) < order.index(torch.ops.aten.relu.default)
    assert order.index(torch.ops.aten.relu.default) < order.index(npugraph_ex.scope_exit.default)
    assert ngr.current_scope() == {}


def test_register_user_stream_names_a_stream_for_a_label() -> None:
    marker = object()
    ngr.register_user_stream("prefill", marker)
    try:
        assert ngr.user_stream("prefill") is marker
    finally:
        ops.forget_user_streams()


def test_an_unknown_label_gets_one_new_stream() -> None:
    try:
        first = ngr.user_stream("decode", "cpu")
        assert isinstance(first, ngr.Stream) and first.device.type == "cpu"
        assert ngr.user_stream("decode", "cpu") is first
        assert ngr.user_stream("other", "cpu") is not first
    finally:
        ops.forget_user_streams()


def test_a_label_must_be_a_non_empty_string() -> None:
    with pytest.raises(NpugraphError, match="label"):
        ngr.user_stream("")
