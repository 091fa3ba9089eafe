"""Data dump (dump_tensor_data): every node's value on disk, compared with eager."""

from __future__ import annotations

import operator
import os
from pathlib import Path

import pytest
import torch
import torch.fx
from npugraph_backend.config import CompilerConfig, OptionError
from npugraph_backend.dfx import data_dump
from npugraph_runtime import make_graphed_callable
from torch.fx.experimental.proxy_tensor import make_fx


def _block(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # A linear layer, a split (multi-output op), a reduction and a topk (two outputs).
    y = torch.nn.functional.linear(x, w, b)
    lo, hi = torch.split(y, 4, dim=1)
    values, indices = torch.topk(y, 2, dim=1)
    return torch.relu(lo) * hi.sum(), values, indices


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 6, generator=g), torch.randn(8, 6, generator=g), torch.randn(8, generator=g)


def _aot_like_graph() -> torch.fx.GraphModule:
    return make_fx(_block, tracing_mode="fake")(*_inputs(0))


class _Recorder(torch.fx.Interpreter):
    """Eager run of a graph that keeps each tensor node's value as it is computed."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, torch.Tensor] = {}

    def run_node(self, n: torch.fx.Node) -> object:
        result = super().run_node(n)
        if isinstance(result, torch.Tensor):
            self.values[n.name] = result.detach().clone()
        return result


def _eager_values(gm: torch.fx.GraphModule, args: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    rec = _Recorder(gm)
    rec.run(*args)
    return rec.values


def _config(tmp_path: Path, stage: str) -> CompilerConfig:
    return CompilerConfig(dump_tensor_data=True, data_dump_stage=stage, data_dump_dir=str(tmp_path))


def _load(root: Path, node: str, count: int) -> torch.Tensor:
    t = torch.load(root / f"{node}_device_0_{count}.pt")
    assert isinstance(t, torch.Tensor)
    return t


def _fresh_counts() -> None:
    # Counts are per file name and process-wide; each test writes into its own tmp dir, so
    # restart them to read the call number directly.
    data_dump._counts.clear()


def test_original_stage_dumps_every_node_with_its_eager_value(tmp_path: Path) -> None:
    _fresh_counts()
    gm = _aot_like_graph()
    args = _inputs(1)
    expected = _eager_values(gm, args)
    run = data_dump.original_runner(gm, _config(tmp_path, "original"))

    out = run(*args)

    for got, want in zip(out, _block(*args), strict=True):
        torch.testing.assert_close(got, want)
    root = tmp_path / "worldsize1_global_rank0"
    assert sorted(os.listdir(root)) == sorted(f"{n}_device_0_0.pt" for n in expected)
    for name, value in expected.items():
        assert torch.equal(_load(root, name, 0), value), name


def test_original_stage_ignores_passes_run_after_it(tmp_path: Path) -> None:
    _fresh_counts()
    gm = _aot_like_graph()
    args = _inputs(2)
    expected = _eager_values(gm, args)
    run = data_dump.original_runner(gm, _config(tmp_path, "original"))
    relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    relu.target = torch.ops.aten.neg.default  # a pass rewriting the graph in place
    gm.recompile()

    run(*args)

    root = tmp_path / "worldsize1_global_rank0"
    assert torch.equal(_load(root, relu.name, 0), expected[relu.name])


def test_multi_output_nodes_are_dumped_through_their_getitems(tmp_path: Path) -> None:
    _fresh_counts()
    gm = _aot_like_graph()
    data_dump.instrument(gm, _config(tmp_path, "optimized"))
    multi = [n.name for n in gm.graph.nodes if n.target in (torch.ops.aten.split.Tensor, torch.ops.aten.topk.default)]

    data_dump.after_each_call(gm, gm)(*_inputs(3))

    files = set(os.listdir(tmp_path / "worldsize1_global_rank0"))
    assert multi and not any(f.startswith(f"{m}_device") for m in multi for f in files)
    getitems = [n.name for n in gm.graph.nodes if n.target is operator.getitem]
    assert len(getitems) == 4
    assert all(f"{g}_device_0_0.pt" in files for g in getitems)


def test_optimized_stage_holds_each_replays_values_across_three_replays(tmp_path: Path) -> None:
    _fresh_counts()
    gm = _aot_like_graph()
    reference = torch.fx.GraphModule(gm, _copy(gm.graph))
    data_dump.instrument(gm, _config(tmp_path, "optimized"))
    first = _inputs(4)
    # The weights are static (never copied), the activations user inputs copied per call.
    graphed = make_graphed_callable(gm, first, static_argnums=(1, 2))
    call = data_dump.after_each_call(graphed, gm)
    root = tmp_path / "worldsize1_global_rank0"
    w, b = first[1], first[2]

    call(*first)  # warm-up and capture
    for count, seed in enumerate((5, 6, 7), start=1):
        x = _inputs(seed)[0]
        out = call(x, w, b)
        for got, want in zip(out, _block(x, w, b), strict=True):
            torch.testing.assert_close(got, want)
        for name, value in _eager_values(reference, (x, w, b)).items():
            assert torch.equal(_load(root, name, count), value), (name, count)
    # replays, not recaptures: the previous call's ``out`` is still held at each call, so the
    # key gets a second capture once and the calls alternate between the two
    assert [e.reason for e in graphed.events] == ["new_key", "held_outputs"]


def _copy(graph: torch.fx.Graph) -> torch.fx.Graph:
    new = torch.fx.Graph()
    new.output(new.graph_copy(graph, {}))
    return new


def test_missing_dump_dir_is_refused_naming_the_option(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data_dump_dir"):
        CompilerConfig(dump_tensor_data=True, data_dump_dir=str(tmp_path / "absent"))
    gone = tmp_path / "gone"
    gone.mkdir()
    config = _config(gone, "optimized")
    gone.rmdir()  # removed between configuration and compile
    with pytest.raises(OptionError, match="data_dump_dir"):
        data_dump.instrument(_aot_like_graph(), config)
    with pytest.raises(OptionError, match="data_dump_dir"):
        data_dump.original_runner(_aot_like_graph(), config)


def test_optimized_stage_refuses_symbolic_shapes_naming_the_stage(tmp_path: Path) -> None:
    gm = make_fx(_block, tracing_mode="symbolic")(*_inputs(0))
    with pytest.raises(OptionError, match="data_dump_stage"):
        data_dump.instrument(gm, _config(tmp_path, "optimized"))


def test_graph_without_shape_metadata_is_refused_naming_the_node(tmp_path: Path) -> None:
    gm = torch.fx.symbolic_trace(_block)
    with pytest.raises(ValueError, match=r"node\.meta"):
        data_dump.instrument(gm, _config(tmp_path, "optimized"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_optimized_stage_dumps_cuda_graph_replays_through_pinned_buffers(tmp_path: Path) -> None:
    _fresh_counts()

    def on_cuda(seed: int) -> tuple[torch.Tensor, ...]:
        return tuple(t.cuda() for t in _inputs(seed))

    first = on_cuda(4)
    gm = make_fx(_block, tracing_mode="fake")(*first)
    reference = torch.fx.GraphModule(gm, _copy(gm.graph))
    data_dump.instrument(gm, _config(tmp_path, "optimized"))
    buffers = [b for name, b in gm.named_buffers() if name.startswith("_npugraph_ex_dump_")]
    assert buffers and all(b.is_pinned() for b in buffers)
    graphed = make_graphed_callable(gm, first, static_argnums=(1, 2))
    call = data_dump.after_each_call(graphed, gm)
    root = tmp_path / "worldsize1_global_rank0"
    w, b = first[1], first[2]

    call(*first)
    for count, seed in enumerate((5, 6, 7), start=1):
        x = on_cuda(seed)[0]
        out = call(x, w, b)
        for got, want in zip(out, _block(x, w, b), strict=True):
            torch.testing.assert_close(got, want)
        for name, value in _eager_values(reference, (x, w, b)).items():
            assert torch.equal(_load(root, name, count), value.cpu()), (name, count)
    assert graphed.num_captures == 1 and len(graphed.events) == 1
