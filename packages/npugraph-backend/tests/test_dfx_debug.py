"""DebugSession, in process: pass files against PassRecord.changed, output_code.py, capture
JSONs. (The TORCH_COMPILE_DEBUG=1 run of a user program is in test_dfx_compile.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.fx
from npugraph_backend.config import CompilerConfig
from npugraph_backend.dfx import debug
from npugraph_passes import PassManager
from npugraph_runtime import CapturePolicy, GraphedCallable, InputSpec
from torch.fx.experimental.proxy_tensor import make_fx


def _f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = (x @ w).view(4, 4).clone()  # a no-op view and clone: remove_noop_ops drops them
    return torch.relu(y) + 1


def _args() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 4), torch.randn(4, 4)


def _session(tmp_path: Path) -> debug.DebugSession:
    return debug.DebugSession(str(tmp_path / "model__0"))


def test_no_session_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_COMPILE_DEBUG", raising=False)
    assert debug.DebugSession.begin(torch.fx.symbolic_trace(torch.nn.ReLU())) is None
    monkeypatch.setenv("TORCH_COMPILE_DEBUG", "0")
    assert debug.DebugSession.begin(None) is None


def test_a_pass_file_differs_from_the_one_before_exactly_when_the_pass_changed_the_graph(
    tmp_path: Path,
) -> None:
    session = _session(tmp_path)
    args = _args()
    gm = make_fx(_f, tracing_mode="fake")(*args)
    session.forward_graph(gm)
    config = CompilerConfig()

    records = PassManager.from_config(config).run(gm, args, config, observer=session.pass_observer)

    forward = tmp_path / "model__0" / "forward"
    names = ["000_aot_forward_graph.txt"] + [
        f"{i:03d}_aot_forward_graph_after_{r.name}.txt" for i, r in enumerate(records, 1)
    ]
    assert sorted(p.name for p in forward.glob("*.txt")) == names
    texts = [(forward / n).read_text() for n in names]
    assert any(r.changed for r in records) and not all(r.changed for r in records)
    for record, before, after in zip(records, texts[:-1], texts[1:], strict=True):
        assert (before != after) == record.changed, record.name
    assert "torch.ops.aten.clone.default" in texts[0]
    assert "torch.ops.aten.clone.default" not in texts[-1]


def test_output_code_is_python_stating_how_each_input_is_run(tmp_path: Path) -> None:
    session = _session(tmp_path)
    args = _args()
    gm = make_fx(_f, tracing_mode="fake")(*args)
    spec = InputSpec.infer(args, static_argnums=(1,))

    path = session.output_code(gm, debug.spec_summary(gm, spec, CapturePolicy(capture_limit=3)))

    code = Path(path).read_text()
    namespace: dict[str, object] = {"__name__": "output_code"}
    exec(compile(code, path, "exec"), namespace)
    run_spec = namespace["RUN_SPEC"]
    assert isinstance(run_spec, dict)
    assert [i["kind"] for i in run_spec["inputs"]] == ["user", "static"]
    assert run_spec["copied_per_call"] == ["x_1"]
    assert run_spec["policy"]["capture_limit"] == 3
    assert "torch.ops.aten.mm.default" in code
    assert "x_1 [user]: copied into the capture's buffer" in code


def test_one_json_per_capture_with_key_reason_inputs_pool_and_op_count(tmp_path: Path) -> None:
    session = _session(tmp_path)
    args = _args()
    gm = make_fx(_f, tracing_mode="fake")(*args)
    spec = InputSpec.infer(args, static_argnums=(1,))
    policy = CapturePolicy(name="dfx_graph", force_recapture=True)
    graphed = GraphedCallable(gm, spec, policy)
    call = session.watch(graphed, debug.spec_summary(gm, spec, policy))

    for _ in range(3):
        x = torch.randn(4, 4)
        torch.testing.assert_close(call(x, args[1]), _f(x, args[1]))

    files = sorted((tmp_path / "model__0").glob("graph_*.json"))
    infos = [json.loads(p.read_text()) for p in files]
    assert [i["reason"] for i in infos] == ["new_key", "force_recapture", "force_recapture"]
    for info, event in zip(infos, graphed.events, strict=True):
        assert info["graph"] == "dfx_graph" and info["captured"]
        # sizes as ints; a hand-written key's dtype and device as their str()
        assert info["key"] == [v if isinstance(v, int) else str(v) for v in event.key]
        assert [i["kind"] for i in info["inputs"]] == ["user", "static"]
        assert info["op_count"] > 0
        assert info["pool"]["device"] == "cpu" and info["pool_bytes"] >= 0


def test_run_dir_names_the_rank_when_distributed_is_initialised(tmp_path: Path) -> None:
    code = (
        "import torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', rank=0, world_size=1)\n"
        "from npugraph_backend.dfx.debug import DebugSession\n"
        "print(DebugSession.begin(None).model_dir)\n"
        "dist.destroy_process_group()\n"
    )
    env = {**os.environ, "TORCH_COMPILE_DEBUG": "1"}
    env.pop("TORCH_COMPILE_DEBUG_DIR", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model_dir = Path(proc.stdout.strip())
    assert model_dir.name == "model__0"
    run_dir = model_dir.parent.parent
    assert run_dir.parent == tmp_path / "torch_compile_debug"
    assert run_dir.name.startswith("run_") and run_dir.name.endswith("-rank_0")
