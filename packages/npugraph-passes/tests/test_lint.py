"""Capture-safety lint: names unsafe nodes with the user's source line; never edits the graph."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from npugraph_passes import _compat, find_unsafe_nodes
from npugraph_passes._compat import compiled_inference_graphs
from npugraph_passes.lint import META_KEY, capture_safety_lint
from torch.fx.experimental.proxy_tensor import make_fx


def _reasons(fn, *inputs):  # type: ignore[no-untyped-def]
    # symbolic tracing keeps data-dependent ops (item, nonzero) in the graph
    gm = make_fx(fn, tracing_mode="symbolic")(*inputs)
    return {(u.target, u.reason.split(" (")[0]) for u in find_unsafe_nodes(gm)}


def test_item_is_a_host_sync() -> None:
    found = _reasons(lambda x: (x * x.sum().item(),), torch.randn(4))
    assert ("aten._local_scalar_dense.default", "host sync") in found


def test_nonzero_and_bool_mask_are_data_dependent() -> None:
    found = _reasons(lambda x: (x.nonzero(), x[x > 0]), torch.randn(4))
    assert ("aten.nonzero.default", "data-dependent output shape") in found
    assert ("aten.index.Tensor", "data-dependent output shape") in found


def test_integer_index_is_safe() -> None:
    assert _reasons(lambda x, i: (x[i] * 2,), torch.randn(4), torch.tensor([0, 2])) == set()


def test_rng_is_unsafe_and_eval_dropout_and_sdpa_are_not() -> None:
    assert ("aten.rand.default", "random number generation") in _reasons(
        lambda x: (x + torch.rand(4),), torch.randn(4)
    )
    q = torch.randn(1, 2, 3, 4)

    def attention(q: torch.Tensor) -> tuple[torch.Tensor]:
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
        return (torch.nn.functional.dropout(out, p=0.5, training=False),)

    assert _reasons(attention, q) == set()


def test_unsafe_node_names_the_user_source_line() -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand_like(x)  # the line the lint must name
        return x + noise

    (gm, _), *_ = compiled_inference_graphs(model, [torch.randn(4)])
    unsafe = find_unsafe_nodes(gm)
    assert len(unsafe) == 1
    assert unsafe[0].source is not None
    assert "test_lint.py" in unsafe[0].source
    assert "noise = torch.rand_like(x)" in unsafe[0].source
    assert "random number generation" in str(unsafe[0])


def test_lint_pass_stores_result_and_leaves_graph_unchanged() -> None:
    gm = make_fx(lambda x: x.nonzero(), tracing_mode="fake")(torch.randn(4))
    before = [n.format_node() for n in gm.graph.nodes]
    capture_safety_lint(gm, [], None)
    assert [u.target for u in gm.meta[META_KEY]] == ["aten.nonzero.default"]
    assert [n.format_node() for n in gm.graph.nodes] == before


def test_safe_cpu_graph_reports_nothing() -> None:
    assert _reasons(lambda x, w: (torch.relu(x @ w).softmax(-1),), torch.randn(2, 3), torch.randn(3, 3)) == set()


def _fake_cuda_graph(fn, *shapes_and_devices):  # type: ignore[no-untyped-def]
    """Traces ``fn`` on fake CUDA tensors: the device checks need a CUDA graph and this machine
    has no GPU (fake tensors stand in for the hardware; no kernel runs)."""
    mode = _compat.fake_tensor_mode()
    with mode:
        inputs = [torch.empty(shape, device=device) for shape, device in shapes_and_devices]
        return make_fx(fn, tracing_mode="real")(*inputs)


def test_device_to_host_copy_inside_a_cuda_graph_is_a_host_sync() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor]:
        host = x.cpu() * 2
        return (host.to(x.device) + x,)

    gm = _fake_cuda_graph(fn, ((4,), "cuda"))
    unsafe = find_unsafe_nodes(gm)
    assert [(u.target, u.reason.split(" (")[0]) for u in unsafe] == [("aten._to_copy.default", "host sync")]


def test_cpu_input_of_a_cuda_graph_is_named_and_cpu_constants_are_not() -> None:
    def fn(x: torch.Tensor, host: torch.Tensor) -> tuple[torch.Tensor]:
        return (x * torch.tensor(2.0) + host.to(x.device),)

    gm = _fake_cuda_graph(fn, ((4,), "cuda"), ((4,), "cpu"))
    unsafe = find_unsafe_nodes(gm)
    assert [(u.name, u.reason) for u in unsafe] == [("host_1", "CPU tensor inside a cuda graph")]


def test_cuda_graph_without_host_work_is_clean() -> None:
    gm = _fake_cuda_graph(lambda x: (x.relu() * 2,), ((4,), "cuda"))
    assert find_unsafe_nodes(gm) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cpu_input_of_a_real_cuda_graph_is_named() -> None:
    def fn(x: torch.Tensor, host: torch.Tensor) -> tuple[torch.Tensor]:
        return (x + host.to(x.device),)

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(4, device="cuda"), torch.randn(4))
    assert [u.reason for u in find_unsafe_nodes(gm)] == ["CPU tensor inside a cuda graph"]


SAFE = {
    "relu": torch.relu,
    "add": lambda t: t + 1,
    "mm": lambda t: t @ torch.ones(t.shape[-1], t.shape[-1]),
    "softmax": lambda t: t.softmax(-1),
    "index": lambda t: t[torch.tensor([0])].expand(t.shape) * 1,
}
UNSAFE = {
    "item": ("aten._local_scalar_dense.default", lambda t: t * t.max().item()),
    "nonzero": ("aten.nonzero.default", lambda t: t + t.nonzero().sum()),
    "randn": ("aten.randn.default", lambda t: t + torch.randn(t.shape)),
}


@settings(max_examples=20, deadline=None)
@given(
    chain=st.lists(st.sampled_from(sorted(SAFE)), min_size=1, max_size=5),
    bad=st.one_of(st.none(), st.sampled_from(sorted(UNSAFE))),
    where=st.integers(0, 5),
)
def test_generated_graphs_flag_exactly_the_unsafe_op(chain: list[str], bad: str | None, where: int) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        for i, name in enumerate(chain):
            if bad is not None and i == min(where, len(chain) - 1):
                x = UNSAFE[bad][1](x)
            x = SAFE[name](x)
        return x

    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(3, 3))
    before = [n.format_node() for n in gm.graph.nodes]
    found = [u.target for u in find_unsafe_nodes(gm)]
    assert found == ([] if bad is None else [UNSAFE[bad][0]])
    assert [n.format_node() for n in gm.graph.nodes] == before
