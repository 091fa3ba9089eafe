"""remove_noop_ops: removes exactly the no-op nodes, keeps results, never aliases outputs to inputs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from npugraph_passes import remove_noop_ops
from npugraph_passes.noop import noop_rules
from torch.fx.experimental.proxy_tensor import make_fx

# rewritten graphs against the original: nox -s ci reruns them
# under a second kernel variant
pytestmark = pytest.mark.numerics

aten = torch.ops.aten

OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "add": lambda x: x + 1,
    "mul": lambda x: x * 2,
    "relu": torch.relu,
    "mm": lambda x: x @ torch.ones(x.shape[-1], x.shape[-1]),
    "slice_full": lambda x: x[:, :],
    "slice_part": lambda x: x[1:] if x.shape[0] > 1 else x,
    "repeat1": lambda x: x.repeat(1, 1),
    "repeat2": lambda x: x.repeat(2, 1),
    "pad0": lambda x: torch.nn.functional.pad(x, (0, 0)),
    "pad1": lambda x: torch.nn.functional.pad(x, (0, 1))[:, :-1],
    "cat1": lambda x: torch.cat([x]),
    "cat2": lambda x: torch.cat([x, x * 3]),
    "pow1": lambda x: x.pow(1),
    "pow2": lambda x: x.pow(2),
    "clone": lambda x: x.clone(),
    "expand_same": lambda x: x.expand(x.shape),
    "permute_id": lambda x: x.permute(0, 1),
    "transpose": lambda x: x.t().contiguous(),
    "mul1": lambda x: x * 1,
    "to_copy": lambda x: x.to(torch.float64).to(torch.float32),
}


def _trace(fn: Callable[..., object], *inputs: torch.Tensor) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*inputs)


def _counts(gm: torch.fx.GraphModule) -> Counter[object]:
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def _run(gm: torch.fx.GraphModule, *inputs: torch.Tensor) -> list[torch.Tensor]:
    out = gm(*inputs)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _check(fn: Callable[..., object], *inputs: torch.Tensor) -> tuple[Counter[object], Counter[object]]:
    gm = _trace(fn, *inputs)
    expected = _run(gm, *inputs)
    before = _counts(gm)
    remove_noop_ops(gm, list(inputs), None)
    gm.graph.lint()
    gm.recompile()
    got = _run(gm, *inputs)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e)
    ptrs = {t.untyped_storage().data_ptr() for t in inputs}
    for g, e in zip(got, expected, strict=True):
        aliased_before = e.untyped_storage().data_ptr() in ptrs
        assert aliased_before or g.untyped_storage().data_ptr() not in ptrs
    return before, _counts(gm)


@settings(max_examples=40, deadline=None)
@given(chain=st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=6), keep_mid=st.booleans())
def test_generated_chains_keep_results_and_only_drop_noop_targets(chain: list[str], keep_mid: bool) -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = []
        for i, name in enumerate(chain):
            x = OPS[name](x)
            if keep_mid and i == 0:
                outs.append(x)
        return (*outs, x)

    before, after = _check(fn, torch.randn(4, 6))
    rules = noop_rules()
    for target, n in before.items():
        if target not in rules:
            # only repeats of one op (two `ones` of the same shape) may merge into one
            assert after[target] == n or 1 <= after[target] < n, target
        else:
            assert after[target] <= n


def test_full_slice_repeat_pad_cat_pow_are_removed() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = x[:, :].repeat(1, 1)
        b = torch.cat([torch.nn.functional.pad(a, (0, 0))]).pow(1)
        return b + y

    _, after = _check(fn, torch.randn(3, 4), torch.randn(3, 4))
    assert set(after) == {aten.add.Tensor}


def test_same_dtype_conversion_and_identity_views_are_removed() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x.expand(3, 4).permute(0, 1) * 1).relu()

    _, after = _check(fn, torch.randn(3, 4))
    assert set(after) == {aten.relu.default}


def test_output_clone_of_input_stays_a_copy() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.clone(), x + 1

    _, after = _check(fn, torch.randn(3))
    assert after[aten.clone.default] == 1


def test_full_slice_of_input_returned_stays() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x[:]

    gm = _trace(fn, torch.randn(3))
    before = _counts(gm)
    remove_noop_ops(gm, [], None)
    assert _counts(gm) == before


def test_clone_written_in_place_by_user_pass_is_kept() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = x.clone()
        c.add_(1)
        return c * 2, x * 3

    x = torch.randn(3)
    gm = _trace(fn, x)
    remove_noop_ops(gm, [x], None)
    gm.recompile()
    assert _counts(gm)[aten.clone.default] == 1
    x2 = x.clone()
    a, b = gm(x2)
    torch.testing.assert_close(a, (x + 1) * 2)
    torch.testing.assert_close(b, x * 3)


def test_copy_removed_earlier_makes_later_views_alias_the_input() -> None:
    # cat([x]) is dropped first; the slice of it is then a view of x, so the second single-input
    # cat, which is returned, must stay a copy.
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.cat([x])[1:]])

    _, after = _check(fn, torch.randn(3, 6))
    assert after[aten.cat.default] == 1


def test_partial_slice_and_real_repeat_are_kept() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x[1:].repeat(2, 1) + 0.5

    before, after = _check(fn, torch.randn(3, 4))
    assert after == before
