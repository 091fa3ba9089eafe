"""remove_repeated_ops (run by remove_noop_ops): a repeated op reads the earlier result, bitwise
the same; constants, writes, randomness, outputs and ordering points keep ops apart."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
from npugraph_passes import remove_noop_ops
from npugraph_passes.repeated import remove_repeated_ops
from torch.fx.experimental.proxy_tensor import make_fx

# rewritten graphs against the original: nox -s ci reruns them
# under a second kernel variant
pytestmark = pytest.mark.numerics

aten = torch.ops.aten


def _trace(fn: Callable[..., object], *inputs: torch.Tensor) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*inputs)


def _counts(gm: torch.fx.GraphModule) -> Counter[object]:
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def _outs(value: object) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (list, tuple)) else [value]  # type: ignore[list-item]


def _removed(fn: Callable[..., object], *inputs: torch.Tensor) -> tuple[int, torch.fx.GraphModule]:
    """Runs the pass; checks that the graph gives bitwise the results it gave before."""
    gm = _trace(fn, *inputs)
    expected = _outs(gm(*[t.clone() for t in inputs]))
    removed = remove_repeated_ops(gm, list(inputs), None)
    gm.graph.lint()
    gm.recompile()
    got = _outs(gm(*[t.clone() for t in inputs]))
    for g, e in zip(got, expected, strict=True):  # bitwise: -0.0 and NaN payloads included
        assert g.dtype == e.dtype and torch.equal(_bits(g), _bits(e))
    return removed, gm


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _mask_per_layer(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # transformers' pattern: the same float mask from a boolean one, once per layer
    for _ in range(3):
        float_mask = torch.where(mask, torch.scalar_tensor(0.0), torch.scalar_tensor(float("-inf")))
        x = torch.softmax(x + float_mask, -1)
    return x


def test_a_mask_built_per_layer_is_built_once() -> None:
    x, mask = torch.randn(2, 8), torch.rand(2, 8) > 0.3
    removed, gm = _removed(_mask_per_layer, x, mask)
    counts = _counts(gm)
    assert counts[aten.where.self] == 1
    assert counts[aten.scalar_tensor.default] == 2
    assert removed == 6
    assert counts[aten._softmax.default] == 3  # different inputs: kept


def test_remove_noop_ops_runs_it() -> None:
    gm = _trace(_mask_per_layer, torch.randn(2, 8), torch.rand(2, 8) > 0.3)
    remove_noop_ops(gm, [], None)
    assert _counts(gm)[aten.where.self] == 1


def test_constants_differing_in_sign_or_type_are_not_merged() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = torch.scalar_tensor(0.0) + x
        b = torch.scalar_tensor(-0.0) + x
        i = x.to(torch.int64)
        return a * 1.5, b * 1.5, (i + 1) * 2, (i + 1.0) * 2, (i + True) * 2

    removed, gm = _removed(fn, torch.tensor([-0.0, 1.0]))
    assert removed == 0
    assert _counts(gm)[aten.scalar_tensor.default] == 2


def test_a_write_between_keeps_both() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x.sum() * 2
        x.add_(1)
        b = x.sum() * 2
        return a, b

    gm = _trace(fn, torch.randn(4))
    # read x itself after the write (make_fx reads the add_ node, which the key tells apart)
    write = next(n for n in gm.graph.nodes if n.target is aten.add_.Tensor)
    for user in list(write.users):
        user.replace_input_with(write, write.args[0])
    gm.recompile()
    x = torch.randn(4)
    expected = gm(x.clone())
    assert remove_repeated_ops(gm, [], None) == 0
    gm.recompile()
    assert _counts(gm)[aten.sum.default] == 2
    assert all(torch.equal(g, e) for g, e in zip(gm(x.clone()), expected, strict=True))


def test_a_result_written_in_place_is_not_shared() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x * 2
        a.add_(1)
        b = x * 2
        return a + 0.5, b + 0.5

    removed, _ = _removed(fn, torch.randn(4))
    assert removed == 0


def test_random_ops_and_outputs_are_not_merged() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x * 3, x * 3, torch.rand_like(x) + torch.rand_like(x)

    gm = _trace(fn, torch.randn(4))
    assert remove_repeated_ops(gm, [], None) == 0
    assert _counts(gm)[aten.rand_like.default] == 2
    a, b, _ = gm(torch.randn(4))
    assert a.data_ptr() != b.data_ptr()


_LIB = torch.library.Library("npugraph_test_repeated", "FRAGMENT")
_LIB.define("marker(Tensor x) -> Tensor")
_LIB.impl("marker", lambda x: x.clone(), "CompositeExplicitAutograd")
_LIB.impl("marker", lambda x: torch.empty_like(x), "Meta")


def test_an_op_outside_aten_is_an_ordering_point() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = (x * 2).sum()
        y = torch.ops.npugraph_test_repeated.marker(x)
        b = (x * 2).sum()
        return a + y.sum(), b

    removed, gm = _removed(fn, torch.randn(4))
    assert removed == 0
    assert _counts(gm)[aten.mul.Tensor] == 2


def test_integer_add_of_zero_is_dropped_float_is_kept() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.arange(4) + 0
        return (i * 2), (x + 0) * 2

    gm = _trace(fn, torch.tensor([-0.0, 1.0, 2.0, 3.0]))
    x = torch.tensor([-0.0, 1.0, 2.0, 3.0])
    expected = gm(x)
    remove_noop_ops(gm, [], None)
    gm.recompile()
    adds = [n for n in gm.graph.nodes if n.target is aten.add.Tensor]
    assert len(adds) == 1 and adds[0].meta["val"].is_floating_point()
    got = gm(x)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(torch.signbit(got[1]), torch.signbit(expected[1]))
