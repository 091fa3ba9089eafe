"""Registration, the AOT pipeline, input/output specs and the serializable compiled graph."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
from npugraph_backend import CompiledGraph, ForwardCompiler, _compat, compile_fx
from npugraph_backend.config import CompilerConfig
from npugraph_runtime import SlotKind
from torch import nn
from torch.testing import assert_close


def test_backend_is_registered_without_importing_us() -> None:
    script = textwrap.dedent(
        """
        import sys, torch, torch._dynamo
        assert "npugraph_ex" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
        f = torch.compile(lambda x, y: torch.add(x, y), backend="npugraph_ex", fullgraph=True,
                          dynamic=False)
        x, y = torch.randn(2, 2), torch.randn(2, 2)
        with torch.no_grad():
            assert torch.equal(f(x, y), x + y)
            assert torch.equal(f(y, x), x + y)
        print("OK", "npugraph_backend" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "OK"


def _aot_compile(fn: Any, args: list[Any], options: dict[str, object] | None = None,
                 mark_static: tuple[int, ...] = ()) -> tuple[Any, list[CompiledGraph]]:
    """torch.compile with a backend that keeps the CompiledGraph our forward compiler returns."""
    made: list[CompiledGraph] = []
    fwd = ForwardCompiler(CompilerConfig.from_options(options))

    def keep(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> CompiledGraph:
        compiled = fwd(gm, example_inputs)
        made.append(compiled)
        return compiled

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return _compat.aot_module_simplified(gm, example_inputs, fw_compiler=keep,
                                             keep_inference_input_mutations=True)

    for i in mark_static:
        _compat.mark_static_address(args[i])
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False), made


class WithBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x: torch.Tensor, cache: torch.Tensor, weights: torch.Tensor) -> Any:
        cache.add_(x)
        self.steps.add_(1)
        return self.lin(x) * self.scale + weights, cache[:1]


@torch.no_grad()
def test_input_kinds_come_from_aot_metadata() -> None:
    model = WithBuffer()
    x, cache, weights = torch.randn(2, 4), torch.zeros(2, 4), torch.randn(2, 4)
    f, made = _aot_compile(model, [x, cache, weights], mark_static=(2,))
    ref_model = WithBuffer()
    ref_model.load_state_dict(model.state_dict())
    ref_cache = cache.clone()
    out = f(x, cache, weights)
    ref = ref_model(x, ref_cache, weights)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(cache, ref_cache)
    torch.testing.assert_close(model.steps, ref_model.steps)
    (compiled,) = made
    kinds = compiled.inputs.kinds
    assert kinds.count(SlotKind.USER) == 1  # x
    assert kinds.count(SlotKind.MUTATED) == 2  # cache, and the buffer updated in place
    assert kinds.count(SlotKind.STATIC) == 4  # weight, bias, scale, mark_static_address
    # The second output is a view of the cache: it aliases that input.
    cache_slot = kinds.index(SlotKind.MUTATED)
    assert cache_slot in compiled.outputs.aliases_input


@torch.no_grad()
def test_compiled_graph_pickles_and_runs_after_load() -> None:
    model = WithBuffer()
    x, cache, weights = torch.randn(2, 4), torch.zeros(2, 4), torch.randn(2, 4)
    f, made = _aot_compile(model, [x, cache, weights], {"clone_output": True})
    f(x, cache, weights)
    (compiled,) = made
    loaded = pickle.loads(pickle.dumps(compiled))
    assert isinstance(loaded, CompiledGraph)
    assert loaded.config.clone_output is True and loaded.inputs == compiled.inputs
    # The loaded graph captures afresh and computes what the original does, on fresh inputs.
    example = [n.meta["val"] for n in compiled.gm.graph.nodes if n.op == "placeholder"]
    for _ in range(3):
        args = [torch.randn(v.shape) for v in example]
        ref_args = [a.clone() for a in args]
        torch.testing.assert_close(loaded(args), compiled(ref_args))
        torch.testing.assert_close(args, ref_args)


def test_forward_compiler_pickles_with_its_options() -> None:
    fwd = ForwardCompiler(CompilerConfig.from_options({"capture_limit": 3}))
    assert pickle.loads(pickle.dumps(fwd)).config.capture_limit == 3


@torch.no_grad()
def test_each_compile_gets_its_own_graph_name_and_counters(counter: Callable[[str], int]) -> None:
    f = torch.compile(lambda x: x + 1, backend="npugraph_ex", fullgraph=True, dynamic=False)
    g = torch.compile(lambda x: x * 3, backend="npugraph_ex", fullgraph=True, dynamic=False)
    x = torch.randn(4)
    torch.testing.assert_close(f(x), x + 1)
    torch.testing.assert_close(g(x), x * 3)
    names = [k for k in _compat.counters() if k.startswith("capture_due_to_new_key_")]
    assert len(set(names)) == 2
    assert counter("capture_due_to_new_key_") == 2


@torch.no_grad()
def test_compile_fx_without_example_inputs_uses_the_recorded_values() -> None:
    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return _compat.aot_module_simplified(gm, example_inputs, fw_compiler=compile_fx)

    model = WithBuffer()
    ref_model = WithBuffer()
    ref_model.load_state_dict(model.state_dict())
    f = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    for _ in range(3):
        x, cache, weights = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
        ref_cache = cache.clone()
        torch.testing.assert_close(f(x, cache, weights), ref_model(x, ref_cache, weights))
        torch.testing.assert_close(cache, ref_cache)


@torch.no_grad()
def test_aliased_inputs_with_a_synthetic_base_stay_correct() -> None:
    # Two overlapping views, one mutated: AOT merges them into one base input that no
    # descriptor maps to a user input. The graph writes it, so it is used in place (MUTATED).
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.add_(1)
        return a * b

    base, ref_base = torch.zeros(8), torch.zeros(8)
    g, made = _aot_compile(f, [base[:4], base[2:6]])
    for _ in range(3):
        torch.testing.assert_close(g(base[:4], base[2:6]), f(ref_base[:4], ref_base[2:6]))
        torch.testing.assert_close(base, ref_base)
    (compiled,) = made
    assert SlotKind.MUTATED in compiled.inputs.kinds
    other = torch.randn(8)
    ref_other = other.clone()
    torch.testing.assert_close(g(other[:4], other[2:6]), f(ref_other[:4], ref_other[2:6]))
    torch.testing.assert_close(other, ref_other)
    torch.testing.assert_close(base, ref_base)


def test_backend_is_listed_by_dynamo() -> None:
    assert "npugraph_ex" in _compat.list_backends()


@torch.no_grad()
def test_without_descriptors_inputs_are_mapped_in_metadata_order() -> None:
    # torch 2.11 may not set node.meta["desc"]: the same kinds come from fw_metadata's order.
    from npugraph_backend.specs import build_specs

    found: dict[str, Any] = {}

    def fw(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        found["with"] = build_specs(gm, example_inputs)
        for node in gm.graph.nodes:
            node.meta.pop("desc", None)
        found["without"] = build_specs(gm, example_inputs)
        return compile_fx(gm, example_inputs)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return _compat.aot_module_simplified(gm, example_inputs, fw_compiler=fw,
                                             keep_inference_input_mutations=True)

    model = WithBuffer()
    f = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    f(torch.randn(2, 4), torch.zeros(2, 4), torch.randn(2, 4))
    assert found["with"].how == "descriptors"
    assert found["without"].how == "metadata order"
    assert found["without"].inputs == found["with"].inputs
    assert found["without"].outputs == found["with"].outputs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model(replays_match_eager: Callable[..., None], dtype: torch.dtype) -> None:
    m = nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 4)).to(dtype)
    replays_match_eager(m, torch.compile(m, backend="npugraph_ex", fullgraph=True, dynamic=False), lambda i: (torch.randn(2, 4, dtype=dtype),))


def test_int64_index_input(replays_match_eager: Callable[..., None]) -> None:
    emb = nn.Embedding(10, 4)

    def f(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return emb(ids) + pos.to(torch.float32).unsqueeze(-1)

    replays_match_eager(f, torch.compile(f, backend="npugraph_ex", fullgraph=True, dynamic=False), lambda i: (torch.randint(0, 10, (2, 3)), torch.arange(3) + i))


def test_called_with_keyword_arguments() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None,
                    shift: float = 0.0) -> torch.Tensor:
            y = self.lin(x)
            if scale is not None:
                y = y * scale
            return y + shift

    m = M()
    c = torch.compile(m, backend="npugraph_ex", fullgraph=True, dynamic=False)
    for _ in range(3):
        x, s = torch.randn(2, 4), torch.randn(4)
        with torch.no_grad():
            assert_close(c(x, scale=s, shift=1.5), m(x, scale=s, shift=1.5))
            assert_close(c(scale=s, x=x), m(x, scale=s))
