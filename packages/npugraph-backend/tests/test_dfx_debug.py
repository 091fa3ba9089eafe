"""TORCH_COMPILE_DEBUG=1 dumps: layout, one file per pass that differs exactly when the pass
changed the graph, output_code.py, capture JSONs. Each test runs Python in a fresh process with
the variable set and a temporary working directory, as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from npugraph_backend.dfx import debug

_PASS_PIPELINE = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from npugraph_backend.config import CompilerConfig
    from npugraph_backend.dfx.debug import DebugSession, spec_summary
    from npugraph_passes import PassManager
    from npugraph_runtime import CapturePolicy, InputSpec
    from npugraph_runtime.manager import GraphedCallable

    def f(x, w):
        y = (x @ w).view(4, 4).clone()   # a no-op view and clone: remove_noop_ops drops them
        return torch.relu(y) + 1

    args = (torch.randn(4, 4), torch.randn(4, 4))
    session = DebugSession.begin(torch.fx.symbolic_trace(f))
    gm = make_fx(f, tracing_mode="fake")(*args)
    session.forward_graph(gm)
    config = CompilerConfig()
    records = PassManager.from_config(config).run(gm, args, config, observer=session.pass_observer)
    spec = InputSpec.infer(args, static_argnums=(1,))
    policy = CapturePolicy(name="dfx_graph")
    summary = spec_summary(gm, spec, policy)
    session.output_code(gm, summary)
    graphed = GraphedCallable(gm, spec, policy)
    call = session.watch(graphed, summary)
    for _ in range(3):
        x = torch.randn(4, 4)
        torch.testing.assert_close(call(x, args[1]), f(x, args[1]))
    json.dump({"model_dir": session.model_dir,
               "records": [[r.name, r.changed] for r in records],
               "keys": [list(e.key) for e in graphed.events]}, sys.stdout)
    """
)


def _run(code: str, cwd: Path, **env: str) -> str:
    full_env = {**os.environ, "TORCH_COMPILE_DEBUG": "1", **env}
    full_env.pop("TORCH_COMPILE_DEBUG_DIR", None)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=full_env, capture_output=True, text=True,
        timeout=240, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_pass_dumps_follow_the_pass_records(tmp_path: Path) -> None:
    result = json.loads(_run(_PASS_PIPELINE, tmp_path))
    model_dir = Path(result["model_dir"])
    records = result["records"]

    # Layout: torch_compile_debug/run_<time>-pid_<pid>/npugraph_ex/model__0/...
    run_dir = model_dir.parent.parent
    assert model_dir.name == "model__0"
    assert model_dir.parent.name == "npugraph_ex"
    assert run_dir.parent == tmp_path / "torch_compile_debug"
    assert run_dir.name.startswith("run_") and "-pid_" in run_dir.name
    assert (model_dir.parent / "debug.log").is_file()
    assert "dfx_graph: captured graph key" in (model_dir.parent / "debug.log").read_text()
    assert (model_dir / "dynamo_out_graph.txt").is_file()

    forward = model_dir / "forward"
    expected = ["000_aot_forward_graph.txt"] + [
        f"{i:03d}_aot_forward_graph_after_{name}.txt" for i, (name, _) in enumerate(records, 1)
    ]
    assert sorted(p.name for p in forward.glob("*.txt")) == expected
    texts = [(forward / name).read_text() for name in expected]
    assert any(changed for _, changed in records) and not all(changed for _, changed in records)
    for (name, changed), before, after in zip(records, texts[:-1], texts[1:], strict=True):
        assert (before != after) == changed, name

    # output_code.py is Python: it runs and states how each input is treated.
    code = (forward / "output_code.py").read_text()
    namespace: dict[str, object] = {"__name__": "output_code"}
    exec(compile(code, "output_code.py", "exec"), namespace)
    spec = namespace["RUN_SPEC"]
    assert isinstance(spec, dict)
    assert [i["kind"] for i in spec["inputs"]] == ["user", "static"]
    assert spec["copied_per_call"] == ["x_1"]
    assert spec["policy"]["capture_limit"] == 64
    assert "torch.ops.aten.mm.default" in code

    # One JSON per capture: three calls, one capture.
    (capture,) = sorted(model_dir.glob("graph_*.json"))
    info = json.loads(capture.read_text())
    assert info["graph"] == "dfx_graph" and info["reason"] == "new_key" and info["captured"]
    assert [info["key"]] == result["keys"]
    assert [i["kind"] for i in info["inputs"]] == ["user", "static"]
    assert info["op_count"] > 0
    assert info["pool"]["device"] == "cpu" and info["pool_bytes"] >= 0


def test_no_session_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_COMPILE_DEBUG", raising=False)
    assert debug.DebugSession.begin(torch.fx.symbolic_trace(torch.nn.ReLU())) is None
    monkeypatch.setenv("TORCH_COMPILE_DEBUG", "0")
    assert debug.DebugSession.begin(None) is None
