"""The npugraph_ex façade: the seed's examples as written (CPU tensors), and the public names."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    from npugraph_backend import _compat

    _compat.dynamo_reset()


def test_quick_start_as_written() -> None:
    # seed/quick_start.md, "使用方法", with .npu() dropped (CPU tensors).
    class Model(torch.nn.Module):
        def __init__(self):  # type: ignore[no-untyped-def]
            super().__init__()

        def forward(self, x, y):  # type: ignore[no-untyped-def]
            return torch.add(x, y)

    model = Model()
    opt_model = torch.compile(model, backend="npugraph_ex", fullgraph=True, dynamic=False)

    x = torch.randn(2, 2)
    y = torch.randn(2, 2)
    out = opt_model(x, y)
    torch.testing.assert_close(out, model(x, y))
    x2, y2 = torch.randn(2, 2), torch.randn(2, 2)
    torch.testing.assert_close(opt_model(x2, y2), x2 + y2)


def test_compile_fx_custom_backend_as_written() -> None:
    # seed/quick_start.md, "功能拓展": torch.npu.npugraph_ex.compile_fx is npugraph_ex.compile_fx.
    from npugraph_backend._compat import aot_module_simplified

    import npugraph_ex

    class Model(torch.nn.Module):
        def __init__(self):  # type: ignore[no-untyped-def]
            super().__init__()

        def forward(self, x, y):  # type: ignore[no-untyped-def]
            x = x + y
            return x

    def custom_compiler(gm: torch.fx.GraphModule, example_inputs):  # type: ignore[no-untyped-def]
        test_options = {
            "clone_input": False
        }
        compiled_graph = npugraph_ex.compile_fx(gm, example_inputs, test_options)
        return compiled_graph

    def custom_backend(gm: torch.fx.GraphModule, example_inputs):  # type: ignore[no-untyped-def]
        return aot_module_simplified(gm, example_inputs, fw_compiler=custom_compiler)

    x = torch.ones([2, 2], dtype=torch.int32)
    y = torch.ones([2, 2], dtype=torch.int32)
    model = torch.compile(Model(), backend=custom_backend, fullgraph=True, dynamic=False)
    ret = model(x, y)
    assert torch.equal(ret, x + y)
    z = torch.full([2, 2], 5, dtype=torch.int32)
    assert torch.equal(model(z, y), z + y)


def test_public_names_of_the_api() -> None:
    import npugraph_ex

    for name in ("CompilerConfig", "compile_fx", "register_replacement", "graph_pool_handle",
                 "inference", "scope"):
        assert hasattr(npugraph_ex, name), name
    assert callable(npugraph_ex.scope.limit_core_num)
    config = npugraph_ex.CompilerConfig()
    config.capture_limit = 8
    with pytest.raises(ValueError, match="capture_limit"):
        config.capture_limit = "8"  # type: ignore[assignment]
    pool = npugraph_ex.graph_pool_handle()
    assert npugraph_ex.CompilerConfig.from_options({"use_graph_pool": pool}).use_graph_pool is pool


def test_config_reexports() -> None:
    from npugraph_backend import CompilerConfig

    import npugraph_ex.config

    assert npugraph_ex.config.CompilerConfig is CompilerConfig


@torch.no_grad()
def test_limit_core_num_inside_a_fullgraph_compiled_function() -> None:
    import npugraph_ex

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        with npugraph_ex.scope.limit_core_num(1, 1):
            y = y + 1
        return y.sin()

    g = torch.compile(f, backend="npugraph_ex", fullgraph=True, dynamic=False)
    x = torch.randn(8)
    torch.testing.assert_close(g(x), f(x))
    torch.testing.assert_close(g(x + 1), f(x + 1))


def test_torch_npu_gets_npugraph_ex_when_it_has_none(tmp_path: pytest.TempPathFactory) -> None:
    # Stand-in for torch_npu (no Ascend hardware here): a module that only adds torch.npu.
    import os
    import subprocess
    import sys
    import textwrap

    pkg = os.path.join(str(tmp_path), "torch_npu")
    os.makedirs(pkg)
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write("import types, torch\ntorch.npu = types.ModuleType('torch.npu')\n")
    script = textwrap.dedent(
        """
        import torch, npugraph_ex
        assert torch.npu.npugraph_ex is npugraph_ex
        assert torch.npu.npugraph_ex.compile_fx is npugraph_ex.compile_fx
        print("OK")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK"
