"""DFX through torch.compile(backend="npugraph_ex") and compile_fx: debug dumps, data dumps and
logging as a user meets them."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

_DEBUG_RUN = textwrap.dedent(
    """
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from npugraph_backend.compiler import compile_fx

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    compiled = torch.compile(model, backend="npugraph_ex", fullgraph=True, dynamic=False,
                             options={"force_recapture": True})
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 8)
            torch.testing.assert_close(compiled(x), model(x))

    def f(x, y):
        return torch.relu(x.view(4, 4).clone() + y)   # a no-op view and clone for the passes

    args = [torch.randn(4, 4), torch.randn(4, 4)]
    gm = make_fx(f, tracing_mode="fake")(*args)
    fn = compile_fx(gm, args, {"force_eager": True})
    torch.testing.assert_close(fn(list(args)), f(*args))
    """
)


def _sections(log: str) -> dict[str, list[tuple[str, bool]]]:
    """Per model dir named in debug.log: the (pass, changed) lines logged after it."""
    out: dict[str, list[tuple[str, bool]]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"debug dumps of this graph go to (\S+)", line)
        if m:
            current = Path(m.group(1)).name
            out[current] = []
            continue
        m = re.search(r"pass (\w+): [\d.]+ ms, changed=(True|False)", line)
        if m and current is not None:
            out[current].append((m.group(1), m.group(2) == "True"))
    return out


def test_debug_dumps_of_compile_and_compile_fx(tmp_path: Path) -> None:
    env = {**os.environ, "TORCH_COMPILE_DEBUG": "1"}
    env.pop("TORCH_COMPILE_DEBUG_DIR", None)
    proc = subprocess.run([sys.executable, "-c", _DEBUG_RUN], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]

    (run_dir,) = (tmp_path / "torch_compile_debug").glob("run_*-pid_*")
    root = run_dir / "npugraph_ex"
    log = (root / "debug.log").read_text()
    sections = _sections(log)
    assert sorted(sections) == ["model__0", "model__1"]
    # torch.compile gives the dynamo graph; compile_fx has none.
    assert (root / "model__0" / "dynamo_out_graph.txt").is_file()
    assert not (root / "model__1" / "dynamo_out_graph.txt").exists()
    for model, records in sections.items():
        forward = root / model / "forward"
        names = ["000_aot_forward_graph.txt"] + [
            f"{i:03d}_aot_forward_graph_after_{p}.txt" for i, (p, _) in enumerate(records, 1)
        ]
        assert sorted(p.name for p in forward.glob("*.txt")) == names, model
        texts = [(forward / n).read_text() for n in names]
        for (name, changed), before, after in zip(records, texts[:-1], texts[1:], strict=True):
            assert (before != after) == changed, (model, name)
        assert (forward / "output_code.py").is_file()
    assert any(c for _, c in sections["model__1"])  # remove_noop_ops drops view and clone

    # force_recapture: three calls, three captures, each with a JSON and a log line with reason.
    captures = sorted((root / "model__0").glob("graph_*.json"))
    reasons = [json.loads(p.read_text())["reason"] for p in captures]
    assert reasons == ["new_key", "force_recapture", "force_recapture"]
    assert log.count("(force_recapture)") == 2
    assert "runs eagerly (force_eager)" in log  # the compile_fx graph falls back, logged
    assert not list((root / "model__1").glob("graph_*.json"))
    spec = json.loads(captures[0].read_text())
    assert "user" in [i["kind"] for i in spec["inputs"]] and spec["op_count"] > 0


@pytest.mark.skipif(
    importlib.util.find_spec("npugraph_ex") is None,
    reason="torch parses TORCH_LOGS when torch is imported, before any backend registers its "
    "logger; the name npugraph_ex resolves there through the npugraph-ex meta-package's module",
)
def test_torch_logs_shows_passes_and_captures() -> None:
    code = textwrap.dedent(
        """
        import torch
        model = torch.nn.Linear(4, 4).eval()
        compiled = torch.compile(model, backend="npugraph_ex", dynamic=False)
        with torch.no_grad():
            compiled(torch.randn(2, 4))
        """
    )
    env = {**os.environ, "TORCH_LOGS": "+npugraph_ex"}
    env.pop("TORCH_COMPILE_DEBUG", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert re.search(r"pass remove_noop_ops: [\d.]+ ms", proc.stderr)
    assert "captured graph key" in proc.stderr


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()


def _calls(tmp_path: Path, stage: str) -> tuple[list[torch.Tensor], list[torch.Tensor], Path]:
    from npugraph_backend.dfx import data_dump

    data_dump._counts.clear()
    model = _model()
    options = {"dump_tensor_data": True, "data_dump_stage": stage, "data_dump_dir": str(tmp_path)}
    compiled = torch.compile(model, backend="npugraph_ex", fullgraph=True, dynamic=False,
                             options=options)
    xs, outs = [], []
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 8)
            out = compiled(x)
            torch.testing.assert_close(out, model(x))
            xs.append(x)
            outs.append(out.clone())
    return xs, outs, tmp_path / "worldsize1_global_rank0"


def _files_of_call(root: Path, count: int) -> dict[str, torch.Tensor]:
    suffix = f"_device_0_{count}.pt"
    return {p.name[: -len(suffix)]: torch.load(p) for p in root.glob(f"*{suffix}")}


@pytest.mark.parametrize("stage", ["optimized", "original"])
def test_compiled_model_dumps_every_call(tmp_path: Path, stage: str, counter: Callable[[str], int]) -> None:
    xs, outs, root = _calls(tmp_path, stage)
    names = None
    for count, (x, out) in enumerate(zip(xs, outs, strict=True)):
        files = _files_of_call(root, count)
        names = names or set(files)
        assert set(files) == names and len(names) >= 6  # params, input, mm/addmm, relu, ...
        assert sum(torch.equal(t, x) for t in files.values()) == 1, count  # the user input
        assert any(torch.equal(t, out) for t in files.values()), count  # the output
    assert not list(root.glob("*_device_0_3.pt"))
    captured = counter("capture_due_to_new_key_")
    assert captured == (1 if stage == "optimized" else 0)


def test_compile_refuses_a_missing_dump_dir(tmp_path: Path) -> None:
    compiled = torch.compile(_model(), backend="npugraph_ex",
                             options={"dump_tensor_data": True,
                                      "data_dump_dir": str(tmp_path / "absent")})
    # dynamo wraps the backend's OptionError; its message names the option and the value.
    with pytest.raises(Exception, match="OptionError: option 'data_dump_dir'"), torch.no_grad():
        compiled(torch.randn(2, 8))


def test_compile_phases_are_profiler_ranges() -> None:
    from npugraph_backend.dfx import ranges
    from torch.profiler import ProfilerActivity, profile

    compiled = torch.compile(_model(), backend="npugraph_ex", dynamic=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
        compiled(torch.randn(2, 8))
    names = {e.name for e in prof.events()}
    assert {ranges.COMPILE, ranges.PASSES} <= names
