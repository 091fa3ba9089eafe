"""inplace_pass never writes into memory that a view (of any alias op, not only the listed view
ops) shares with a returned tensor, after the tensor itself was re-inplaced."""

from __future__ import annotations

from collections.abc import Callable

import npugraph_runtime  # noqa: F401  (registers the npugraph_ex scope/record/wait ops)
import pytest
import torch
from npugraph_passes._compat import aot_inference_graph
from npugraph_passes.reinplace import inplace_pass

aten = torch.ops.aten

VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "detach": lambda y: y.detach(),
    "split": lambda y: y.split(2)[1],  # one view of split's list of views
}


@pytest.mark.parametrize("view", list(VIEWS))
def test_op_on_a_view_of_a_reinplaced_intermediate_stays_functional(view: str) -> None:
    of = VIEWS[view]

    def step(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, bias: torch.Tensor,
             acc: torch.Tensor) -> tuple[torch.Tensor]:
        y = torch.nn.functional.linear(x, w, b) + bias  # the add is reinplaced into the linear's
        acc.add_(of(y) * 0.1)  # ... so the view reads that memory, which is returned
        return (y,)

    acc_shape = of(torch.empty(4, 16)).shape
    inputs = [torch.randn(4, 16), torch.randn(16, 16), torch.randn(16), torch.randn(16),
              torch.zeros(acc_shape)]
    gm, _ = aot_inference_graph(step, inputs)
    inplace_pass(gm, inputs, None)
    gm.recompile()
    assert aten.mul_.Tensor not in {n.target for n in gm.graph.nodes}
    (got,) = gm(*inputs[:4], inputs[4].clone())
    torch.testing.assert_close(got, step(*inputs[:4], torch.zeros(acc_shape))[0])
