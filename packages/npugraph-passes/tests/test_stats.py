"""graph_stats and bytes_copied_per_step for the benchmark."""

from __future__ import annotations

import torch
from npugraph_passes._compat import aot_inference_graph
from npugraph_passes.reinplace import input_inplace_pass
from npugraph_passes.stats import bytes_copied_per_step, graph_stats


def test_graph_stats_counts_nodes_by_op_and_target() -> None:
    gm, _ = aot_inference_graph(lambda x: (x.sin() + x.sin(),), [torch.randn(3)])
    stats = graph_stats(gm)
    assert stats["nodes"] == len(gm.graph.nodes)
    assert stats["by_op"]["placeholder"] == 1
    assert stats["by_target"]["aten.sin.default"] == 2


def test_bytes_copied_counts_whole_cache_epilogue_then_nothing() -> None:
    def step(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor]:
        cache.index_copy_(1, pos, new)
        return (cache.mean(),)

    inputs = [torch.zeros(2, 32, 8, dtype=torch.float16), torch.tensor([5]), torch.ones(2, 1, 8, dtype=torch.float16)]
    gm, ex = aot_inference_graph(step, inputs)
    assert bytes_copied_per_step(gm, ex) == 2 * 32 * 8 * 2
    input_inplace_pass(gm, ex, None)
    assert bytes_copied_per_step(gm, ex) == 0


def test_bytes_copied_counts_slice_writes_by_their_size() -> None:
    def step(buf: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor]:
        buf[1:3] = v
        return (buf.sum(),)

    inputs = [torch.zeros(10, 4), torch.ones(2, 4)]
    gm, ex = aot_inference_graph(step, inputs)
    input_inplace_pass(gm, ex, None)
    assert bytes_copied_per_step(gm, ex) == 2 * 4 * 4
