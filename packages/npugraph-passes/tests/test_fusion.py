"""pattern_fusion_pass and register_replacement: torch's matcher over our own pattern table."""

from __future__ import annotations

from collections import Counter

import npugraph_runtime  # noqa: F401  (registers the npugraph_ex scope ops)
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from npugraph_passes import register_replacement
from npugraph_passes._compat import aot_inference_graph
from npugraph_passes.fusion import pattern_fusion_pass, pattern_pass
from npugraph_passes.npu_patterns import register_npu_patterns

# rewritten graphs against the original: nox -s ci reruns them
# under a second kernel variant
pytestmark = pytest.mark.numerics

aten = torch.ops.aten


def _counts(gm: torch.fx.GraphModule) -> Counter[object]:
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def _fuse(fn, *inputs: torch.Tensor) -> tuple[Counter[object], Counter[object]]:  # type: ignore[no-untyped-def]
    gm, ex = aot_inference_graph(fn, list(inputs))
    expected = gm(*inputs)
    before = _counts(gm)
    pattern_fusion_pass(gm, ex, None)
    gm.graph.lint()
    gm.recompile()
    got = gm(*inputs)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            assert isinstance(node.meta.get("val"), torch.Tensor | tuple | list), node
    return before, _counts(gm)


def test_mm_plus_bias_becomes_addmm() -> None:
    before, after = _fuse(lambda x, w, b: (x @ w + b,), torch.randn(3, 4), torch.randn(4, 5), torch.randn(5))
    assert before[aten.mm.default] == 1
    assert after[aten.addmm.default] == 1
    assert after[aten.mm.default] == after[aten.add.Tensor] == 0


def test_bias_first_and_bmm_become_addmm_and_baddbmm() -> None:
    def fn(x, w, b, y, z, c):  # type: ignore[no-untyped-def]
        return b + torch.mm(x, w), torch.bmm(y, z) + c

    inputs = (torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 5), torch.randn(2, 3, 4),
              torch.randn(2, 4, 5), torch.randn(2, 3, 5))
    _, after = _fuse(fn, *inputs)
    assert after[aten.addmm.default] == 1
    assert after[aten.baddbmm.default] == 1
    assert after[aten.add.Tensor] == 0


def test_bias_that_broadcasts_beyond_the_product_is_not_fused() -> None:
    before, after = _fuse(lambda x, w, b: (x @ w + b,), torch.randn(3, 4), torch.randn(4, 5), torch.randn(2, 3, 5))
    assert after == before


def test_bias_of_another_dtype_is_not_fused() -> None:
    before, after = _fuse(
        lambda x, w, b: (x @ w + b,), torch.randn(3, 4), torch.randn(4, 5), torch.randn(5, dtype=torch.float64)
    )
    assert after == before


def test_product_used_twice_is_not_fused() -> None:
    def fn(x, w, b):  # type: ignore[no-untyped-def]
        p = x @ w
        return p + b, p * 2

    before, after = _fuse(fn, torch.randn(3, 4), torch.randn(4, 5), torch.randn(5))
    assert after == before


def test_match_across_streams_is_refused() -> None:
    gm, ex = aot_inference_graph(lambda x, w, b: (x @ w + b,), [torch.randn(3, 4), torch.randn(4, 5), torch.randn(5)])
    graph = gm.graph
    mm = next(n for n in graph.nodes if n.target is aten.mm.default)
    with graph.inserting_before(mm):
        graph.call_function(torch.ops.npugraph_ex.scope_enter.default, (["_user_stream_label"], ["side"]))
    with graph.inserting_after(mm):
        graph.call_function(torch.ops.npugraph_ex.scope_exit.default, ())
    before = _counts(gm)
    pattern_fusion_pass(gm, ex, None)
    assert _counts(gm) == before


def test_user_replacement_fires_and_respects_extra_check() -> None:
    def search(x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x) * x

    def replace(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x)

    # The rule is process-global: the check keeps it to this test's shapes (7 columns).
    def check(match: object) -> bool:
        val = match.kwargs["x"].meta["val"]  # type: ignore[attr-defined]
        return bool(val.dim() == 2 and val.shape[-1] == 7)

    register_replacement(search, replace, [torch.empty(4)], extra_check=check)
    _, flat = _fuse(lambda x: (torch.sigmoid(x) * x,), torch.randn(7))
    assert flat[aten.silu.default] == 0
    _, square = _fuse(lambda x: (torch.sigmoid(x) * x,), torch.randn(3, 7))
    assert square[aten.silu.default] == 1
    assert square[aten.sigmoid.default] == 0


def test_rules_go_into_our_pass_not_inductors() -> None:
    from torch._inductor.fx_passes import post_grad

    ours = pattern_pass()
    assert ours is not post_grad.pass_patterns[0]
    assert any(target is aten.add.Tensor for _, target in ours.patterns)


def test_npu_rules_need_torch_npu_ops() -> None:
    registered: list[object] = []
    count = register_npu_patterns(lambda *args: registered.append(args))
    has_npu = hasattr(torch, "npu") and hasattr(torch.ops.npu, "npu_add_rms_norm")
    assert (count > 0) == has_npu
    assert len(registered) == count


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 4), k=st.integers(1, 4), n=st.integers(1, 4),
    bias=st.sampled_from(["row", "full", "scalar_tensor", "bigger", "col"]),
    bias_first=st.booleans(), batched=st.booleans(),
)
def test_generated_products_with_bias(m: int, k: int, n: int, bias: str, bias_first: bool, batched: bool) -> None:
    b = 2 if batched else None
    lead = (b,) if b else ()
    x, w = torch.randn(*lead, m, k), torch.randn(*lead, k, n)
    shape = {"row": (n,), "full": (*lead, m, n), "scalar_tensor": (), "bigger": (3, *lead, m, n), "col": (m, 1)}[bias]
    c = torch.randn(shape)
    op = torch.bmm if batched else torch.mm

    def fn(x, w, c):  # type: ignore[no-untyped-def]
        return (c + op(x, w),) if bias_first else (op(x, w) + c,)

    before, after = _fuse(fn, x, w, c)
    fused = aten.baddbmm.default if batched else aten.addmm.default
    if bias == "bigger":
        assert after == before
    else:
        assert after[fused] == 1
        assert sum(after.values()) == sum(before.values()) - 1


def test_registering_a_replacement_changes_the_pass_manager_identity() -> None:
    from types import SimpleNamespace

    from npugraph_passes import PassManager

    before = PassManager.from_config(SimpleNamespace()).identity()
    off = PassManager.from_config(SimpleNamespace(pattern_fusion_pass=False)).identity()

    def search(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 3.0

    def replace(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x).mul(3.0)

    register_replacement(search, replace, [torch.empty(4)])
    assert PassManager.from_config(SimpleNamespace()).identity() != before
    assert PassManager.from_config(SimpleNamespace(pattern_fusion_pass=False)).identity() == off
