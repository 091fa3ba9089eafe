"""Private torch APIs the benchmarks and the demo read, each with the torch versions it was checked
on (2.13.0 here; 2.11 on the GPU machines). Everything has a fallback: a benchmark that cannot
reach one of these reports the figure as skipped, never a wrong number."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def dynamo_counters() -> dict[str, dict[str, int]]:
    """torch._dynamo.utils.counters (checked on 2.11, 2.13.0): where the runtime counts captures."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return counters  # type: ignore[return-value]


def aot_graph_backend(
    fw_compiler: Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]],
) -> Callable[..., Any]:
    """A torch.compile backend that runs AOTAutograd (inference graph, input mutations kept) and
    hands the ATen graph to ``fw_compiler``. torch._dynamo.backends.common.aot_autograd and
    functorch.compile.make_boxed_func, checked on 2.11 and 2.13.0."""
    from functorch.compile import make_boxed_func  # type: ignore[import-untyped]
    from torch._dynamo.backends.common import aot_autograd

    def boxed(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compiled = fw_compiler(gm, example_inputs)
        if getattr(compiled, "_boxed_call", False):  # already takes one list, as AOT calls it
            return compiled
        return make_boxed_func(compiled)  # type: ignore[no-any-return]

    return aot_autograd(fw_compiler=boxed, keep_inference_input_mutations=True)  # type: ignore[no-any-return]
