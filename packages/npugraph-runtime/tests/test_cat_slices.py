"""A cat in the replay is one ``copy_`` per input into its slice of the output, and a sign flip
that only the cat reads writes straight into its slice (cpu_replay._split_cats): bitwise the
same bytes as eager's cat, NaN payloads and signs and -0.0 included, over fresh inputs.

Which kernel re-issues each op follows a fixed rule (cpu_kernels), never a timing, so what these
tests check about the rewrite does not depend on how loaded the machine is."""

from __future__ import annotations

from collections.abc import Callable

import npugraph_runtime as ngr
import pytest
import torch

# replay kernels chosen by a bitwise check against eager: nox -s ci reruns them
# under a second kernel variant
pytestmark = pytest.mark.numerics


def _capture(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> tuple[ngr.Graph, torch.Tensor]:
    g = ngr.Graph("cpu")
    with torch.no_grad(), ngr.graph(g):
        out = fn(*inputs)
    return g, out


def _rotate_half(q: torch.Tensor) -> torch.Tensor:  # transformers' RoPE helper
    half = q.shape[-1] // 2
    return torch.cat((-q[..., half:], q[..., :half]), dim=-1) * 1.0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int64)


def _odd_values(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(shape, dtype=dtype)
    flat = x.view(-1)
    specials = torch.tensor([float("nan"), -float("nan"), -0.0, 0.0, float("inf"), -float("inf"), 1e-40],
                            dtype=dtype)
    flat[: specials.numel()] = specials
    return x[torch.randperm(x.shape[0])].contiguous()


def _lines_of(g: ngr.Graph, op: str) -> list[list[str]]:
    per_op, lines, _ = g._replay.__ops__  # type: ignore[attr-defined]
    found = []
    for i, (step, _kind, first) in enumerate(per_op):
        last = per_op[i + 1][2] if i + 1 < len(per_op) else len(lines)
        if str(step.func) == op:
            found.append(lines[first:last])
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotate_half_writes_the_sign_flip_into_the_cat_and_keeps_every_bit(dtype: torch.dtype) -> None:
    q = _odd_values((8, 12, 1, 64), dtype)
    g, out = _capture(_rotate_half, q)
    cats = _lines_of(g, "aten.cat.default")
    assert len(cats) == 1 and len(cats[0]) == 1 and "out=" not in cats[0][0]  # one copy: x1
    assert all("out=" in line for lines in _lines_of(g, "aten.neg.default") for line in lines)
    for _ in range(5):
        q.copy_(_odd_values(q.shape, dtype))
        g.replay()
        assert torch.equal(_bits(out), _bits(_rotate_half(q)))


def test_a_cat_of_views_and_a_result_read_twice_copies_each_input() -> None:
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        n = -a
        return torch.cat((b.t(), n, b[:2]), dim=0) + n.sum()  # n is read again: no redirect

    a, b = torch.randn(3, 4), torch.randn(4, 4)
    g, out = _capture(fn, a, b)
    cats = _lines_of(g, "aten.cat.default")
    assert len(cats) == 1 and len(cats[0]) == 3 and not any("out=" in s for s in cats[0])
    for _ in range(5):
        a.copy_(_odd_values((3, 4), torch.float32))
        b.copy_(_odd_values((4, 4), torch.float32))
        g.replay()
        assert torch.equal(_bits(out), _bits(fn(a, b)))


def test_a_cat_of_other_dtypes_or_empty_inputs_keeps_the_cat_kernel() -> None:
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat((a * 2, b * 2), dim=1)  # float64 and float32: a promoting cat

    a, b = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 5)
    g, out = _capture(fn, a, b)
    assert all("out=" in s for lines in _lines_of(g, "aten.cat.default") for s in lines)
    for _ in range(5):
        a.copy_(torch.randn(2, 3))
        b.copy_(torch.randn(2, 5))
        g.replay()
        assert torch.equal(out, fn(a, b))
