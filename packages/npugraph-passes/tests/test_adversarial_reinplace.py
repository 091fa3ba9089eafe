"""inplace_pass never writes into memory a detached view shares with a returned tensor."""

from __future__ import annotations

import npugraph_runtime  # noqa: F401  (registers the npugraph_ex scope/record/wait ops)
import torch
from npugraph_passes._compat import aot_inference_graph
from npugraph_passes.reinplace import inplace_pass

aten = torch.ops.aten


def test_op_on_a_detached_view_of_a_reinplaced_intermediate_stays_functional() -> None:
    def step(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, bias: torch.Tensor,
             acc: torch.Tensor) -> tuple[torch.Tensor]:
        y = torch.nn.functional.linear(x, w, b) + bias  # the add is reinplaced into the linear's
        acc.add_(y.detach() * 0.1)  # ... so the detach views that memory, which is returned
        return (y,)

    inputs = [torch.randn(4, 16), torch.randn(16, 16), torch.randn(16), torch.randn(16),
              torch.zeros(4, 16)]
    gm, _ = aot_inference_graph(step, inputs)
    inplace_pass(gm, inputs, None)
    gm.recompile()
    muls = [n for n in gm.graph.nodes if n.target in (aten.mul.Tensor, aten.mul_.Tensor)]
    assert [n.target for n in muls] == [aten.mul.Tensor]
    acc = inputs[4].clone()
    (got,) = gm(*inputs[:4], acc)
    torch.testing.assert_close(got, step(*inputs[:4], torch.zeros(4, 16))[0])
