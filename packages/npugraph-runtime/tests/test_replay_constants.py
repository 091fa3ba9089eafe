"""Input-free factory ops (arange, scalar_tensor) replay as a copy of the result saved at
capture (cpu_replay._constant_value), into a buffer the pool may share with other
intermediates: every replay writes it again, so replays over fresh inputs equal eager."""

from __future__ import annotations

import re
from collections.abc import Callable

import npugraph_runtime as ngr
import torch


def _capture(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> tuple[ngr.Graph, torch.Tensor]:
    g = ngr.Graph("cpu")
    with torch.no_grad(), ngr.graph(g):
        out = fn(*inputs)
    return g, out


def _callees(g: ngr.Graph, op: str) -> list[str]:
    """Per replay line of ``op``: "saved" for ``buffer.copy_(tensor)`` from a bound tensor,
    else "call"."""
    per_op, lines, namespace = g._replay.__ops__  # type: ignore[attr-defined]
    found = []
    for i, (step, _kind, first) in enumerate(per_op):
        last = per_op[i + 1][2] if i + 1 < len(per_op) else len(lines)
        if str(step.func) != op:
            continue
        for line in lines[first:last]:
            m = re.fullmatch(r"(v\d+)\((v\d+)\)", line)
            saved = (m is not None and getattr(namespace[m[1]], "__name__", "") == "copy_"
                     and isinstance(namespace[m[2]], torch.Tensor))
            found.append("saved" if saved else "call")
    return found


def _masked(x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    # transformers' causal mask in small: positions up to the current one see 0, the rest -inf
    keep = torch.arange(x.shape[-1]) <= position
    big = (x * 2.0).exp()  # an intermediate that may share the pool with the constants
    mask = torch.ops.aten.where.self(
        keep, torch.ops.aten.scalar_tensor.default(0.0, dtype=x.dtype),
        torch.ops.aten.scalar_tensor.default(float("-inf"), dtype=x.dtype))
    return (big + mask).softmax(-1) + torch.arange(0.5, 3.0, 0.5, dtype=x.dtype).sum()


def test_input_free_factories_replay_as_saved_copies_equal_to_eager() -> None:
    x, position = torch.randn(3, 16), torch.tensor([4])
    g, out = _capture(_masked, x, position)
    assert _callees(g, "aten.arange.default") == ["saved"]
    assert _callees(g, "aten.arange.start_step") == ["saved"]
    assert _callees(g, "aten.scalar_tensor.default") == ["saved", "saved"]
    for i in range(5):
        x.copy_(torch.randn(3, 16))
        position.fill_(i * 3)
        g.replay()
        assert torch.equal(out, _masked(x, position))


def test_a_factory_that_reads_an_input_is_recomputed() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.full_like(x, 2.0) + torch.arange(3) * x

    x = torch.randn(3)
    g, out = _capture(fn, x)
    assert _callees(g, "aten.full_like.default") == ["call"]
    assert _callees(g, "aten.arange.default") == ["saved"]
    for _ in range(5):
        x.copy_(torch.randn(3))
        g.replay()
        assert torch.equal(out, fn(x))
