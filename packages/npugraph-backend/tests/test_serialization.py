"""The backend's compiled graph is serializable: torch's bundled AOTAutograd cache and the
mega-cache (save_cache_artifacts / load_cache_artifacts) hit in a fresh process."""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from npugraph_backend import CompiledGraph, CompilerConfig, _compat
from npugraph_backend.saved_forward import LoadedGraph, saved_forward
from npugraph_backend.serialization import (
    SerializableCompiledGraph,
    cache_tag,
    observe_compiled,
    ops_filter,
)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.add_(1.0)  # an input mutation: kept in the graph, the spec marks it MUTATED
        return torch.relu(self.norm(self.linear(x))) + cache


def _compile_serializable(model: torch.nn.Module, *args: torch.Tensor) -> CompiledGraph:
    """Compile with the bundled AOTAutograd cache on and return our CompiledGraph."""
    import torch._functorch.config as functorch_config

    seen: list[CompiledGraph] = []
    compiled = torch.compile(model, backend="npugraph_ex", fullgraph=True)
    with (
        functorch_config.patch(bundled_autograd_cache=True),
        observe_compiled(seen.append),
        torch.no_grad(),
    ):
        compiled(*args)
    [graph] = seen
    return graph


@pytest.fixture(autouse=True)
def fresh_torch_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty AOTAutograd cache folder: every compile here is a miss, never an earlier run's hit."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch_cache"))


def test_saved_graph_loads_and_matches_eager() -> None:
    model = Block().eval()
    graph = _compile_serializable(model, torch.randn(4, 16), torch.zeros(4, 16))
    on_disk = copy.copy(SerializableCompiledGraph(graph))
    on_disk.prepare_for_serialization()
    assert on_disk.compiled is None and isinstance(on_disk.state, bytes)
    loaded = pickle.loads(pickle.dumps(on_disk))
    loaded.post_compile([], None, {})
    assert isinstance(loaded.compiled, CompiledGraph) and loaded.compiled is not graph
    assert loaded.compiled.runner is not None  # the capture manager is rebuilt
    assert loaded.compiled.inputs == graph.inputs and loaded.compiled.outputs == graph.outputs
    assert loaded.compiled.gm.code == graph.gm.code


def _saved_and_loaded(model: torch.nn.Module, *args: torch.Tensor) -> tuple[CompiledGraph, CompiledGraph]:
    graph = _compile_serializable(model, *args)
    on_disk = copy.copy(SerializableCompiledGraph(graph))
    on_disk.prepare_for_serialization()
    loaded = pickle.loads(pickle.dumps(on_disk))
    loaded.post_compile([], None, {})
    assert isinstance(loaded.compiled, CompiledGraph)
    return graph, loaded.compiled


def test_a_loaded_graph_runs_its_saved_code_without_rebuilding_the_fx_graph() -> None:
    model = Block().eval()
    graph, loaded = _saved_and_loaded(model, torch.randn(4, 16), torch.zeros(4, 16))
    assert isinstance(loaded.gm, LoadedGraph)
    counters = _compat.dynamo_counters()
    counters.clear()
    cache_ours, cache_eager = torch.zeros(4, 16), torch.zeros(4, 16)
    with torch.no_grad():
        for _ in range(6):  # warm-up and capture, then 5 replays with fresh inputs
            x = torch.randn(4, 16)
            [got] = loaded(_graph_args(model, x, cache_ours))
            torch.testing.assert_close(got, model(x, cache_eager))
            torch.testing.assert_close(cache_ours, cache_eager)
            del got  # a held output would make the next call capture again
    assert sum(v for k, v in counters["npugraph_ex"].items() if k.startswith("captured")) == 1
    assert loaded.gm._module is None  # the FX graph was never unpickled
    assert loaded.gm.code == graph.gm.code  # and is there when asked for


@pytest.mark.parametrize("bytecode", ["this interpreter's", "another interpreter's"])
def test_the_saved_forward_computes_what_the_fx_graph_does(bytecode: str) -> None:
    """The saved code object is used by an interpreter with the same magic number; any other
    compiles the saved source. Either way the forward is the FX graph's, bitwise."""
    model = Block().eval()
    graph = _compile_serializable(model, torch.randn(4, 16), torch.zeros(4, 16))
    saved = saved_forward(graph.gm, ())
    assert saved is not None
    if bytecode == "another interpreter's":
        saved = {**saved, "magic": b"\x00\x00\r\n", "bytecode": b"not marshal data"}
    loaded = LoadedGraph(pickle.loads(pickle.dumps(saved)), b"")
    with torch.no_grad():
        for _ in range(5):
            x, cache = torch.randn(4, 16), torch.randn(4, 16)
            cache_fx = cache.clone()
            want = graph.gm.forward(*_graph_args(model, x, cache_fx))
            got = loaded.forward(*_graph_args(model, x, cache))
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            torch.testing.assert_close(cache, cache_fx, rtol=0, atol=0)


def _graph_args(model: Block, x: torch.Tensor, cache: torch.Tensor) -> list[torch.Tensor]:
    """Block's AOT graph inputs, in dynamo's order (first use in forward)."""
    return [cache, model.linear.weight, model.linear.bias, x, model.norm.weight, model.norm.bias]


class WithConstant(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor([1.0, 2.0, 3.0, 4.0])  # a constant of the graph (get_attr)


def test_a_graph_whose_forward_reads_more_than_its_arguments_is_rebuilt_on_load() -> None:
    model = WithConstant().eval()
    graph, loaded = _saved_and_loaded(model, torch.randn(2, 4))
    assert any(n.op == "get_attr" for n in graph.gm.graph.nodes)
    assert isinstance(loaded.gm, torch.fx.GraphModule)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(2, 4)
            [got] = loaded([x])
            torch.testing.assert_close(got, model(x))


def test_cache_hit_after_reset_runs_the_loaded_graph_like_eager() -> None:
    import torch._functorch.config as functorch_config

    model = Block().eval()
    x = torch.randn(4, 16)
    _compile_serializable(model, x, torch.zeros(4, 16))
    _compat.dynamo_reset()  # forget the compiled code: the next compile must come from disk
    _compat.dynamo_counters().clear()
    seen: list[CompiledGraph] = []
    compiled = torch.compile(model, backend="npugraph_ex", fullgraph=True)
    cache_ours, cache_eager = torch.zeros(4, 16), torch.zeros(4, 16)
    with (
        functorch_config.patch(bundled_autograd_cache=True),
        observe_compiled(seen.append),
        torch.no_grad(),
    ):
        for step in range(3):  # warm-up, capture, replay
            xi = x + step
            torch.testing.assert_close(compiled(xi, cache_ours), model(xi, cache_eager))
            torch.testing.assert_close(cache_ours, cache_eager)
    assert _compat.dynamo_counters()["aot_autograd"]["autograd_cache_hit"] == 1
    assert seen == []  # our compiler (and its passes) did not run


def test_original_graph_keeps_running_after_a_copy_is_saved() -> None:
    model = Block().eval()
    graph = _compile_serializable(model, torch.randn(4, 16), torch.zeros(4, 16))
    original = SerializableCompiledGraph(graph)
    saved = copy.copy(original)
    saved.prepare_for_serialization()
    assert original.compiled is graph


def test_ops_filter_admits_our_collective_and_npu_ops_only() -> None:
    assert ops_filter("torch.ops.aten.addmm.default")
    assert ops_filter("torch.ops.npugraph_ex.record.default")
    assert ops_filter("torch.ops._c10d_functional.all_reduce.default")
    assert ops_filter("torch.ops.npu.npu_fused_infer_attention_score.default")
    assert not ops_filter("torch.ops.mylib.custom.default")


def test_graph_with_a_user_pool_is_not_cached() -> None:
    import npugraph_runtime

    model = Block().eval()
    graph = _compile_serializable(model, torch.randn(4, 16), torch.zeros(4, 16))
    graph.config = CompilerConfig(use_graph_pool=npugraph_runtime.graph_pool_handle("cpu"))
    saved = copy.copy(SerializableCompiledGraph(graph))
    with pytest.raises(Exception, match="use_graph_pool") as info:
        saved.prepare_for_serialization()
    assert type(info.value).__name__ == "BypassAOTAutogradCache"


def test_cache_tag_changes_with_options_and_user_passes() -> None:
    def my_pass(gm: Any, example_inputs: Any, config: Any) -> None:
        return None

    base = cache_tag(CompilerConfig())
    assert cache_tag(CompilerConfig()) == base
    assert cache_tag(CompilerConfig(capture_limit=3)) != base
    assert cache_tag(CompilerConfig(post_grad_custom_post_pass=my_pass)) != base


_MEGA = textwrap.dedent(
    """
    import json, sys
    import torch, torch._functorch.config
    torch._functorch.config.bundled_autograd_cache = True
    from torch._dynamo.utils import counters

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)
            self.norm = torch.nn.LayerNorm(16)

        def forward(self, x):
            return torch.relu(self.norm(self.linear(x))) * 2

    mode, blob = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = Block().eval()
    if mode == "load":
        torch.compiler.load_cache_artifacts(open(blob, "rb").read())
    compiled = torch.compile(model, backend="npugraph_ex", fullgraph=True,
                             options={"capture_limit": 4})
    errors = []
    with torch.no_grad():
        for seed in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
            errors.append(float((compiled(x) - model(x)).abs().max()))
    if mode == "save":
        open(blob, "wb").write(torch.compiler.save_cache_artifacts()[0])
    print(json.dumps({"aot": dict(counters["aot_autograd"]), "max_error": max(errors),
                      "captures": sum(v for k, v in counters["npugraph_ex"].items()
                                      if k.startswith("captured_"))}))
    """
)


def _mega(tmp_path: Path, mode: str) -> dict[str, Any]:
    script = tmp_path / "mega.py"
    script.write_text(_MEGA)
    # a fresh torch cache folder per process: a hit can only come from the artifacts
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor_{mode}"))
    out = subprocess.run(
        [sys.executable, str(script), mode, str(tmp_path / "artifacts.bin")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_mega_cache_hits_in_a_fresh_process(tmp_path: Path) -> None:
    # Both sides in fresh processes: torch's cache key pickles globals such as
    # torch.contiguous_format under the first module that reaches them, which under pytest can
    # be a conftest, so a key computed here would not match one computed in a plain process.
    saved = _mega(tmp_path, "save")
    assert saved["aot"].get("autograd_cache_saved") == 1
    loaded = _mega(tmp_path, "load")
    assert loaded["aot"].get("autograd_cache_hit") == 1
    assert "autograd_cache_miss" not in loaded["aot"]  # no AOT, no passes in that process
    assert loaded["max_error"] == 0.0
    assert loaded["captures"] == 1  # device graph rebuilt and captured on load
