"""`npugraph-ex demo` as the README runs it: a subprocess whose tokens must equal eager's."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from npugraph_ex.models import build_decoder

PROMPT = 8


def run_demo(out: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "npugraph_ex.cli", "demo", "--quick", "--no-progress",
         "--out", str(out), *extra],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads((out / "demo.json").read_text())


def eager_tokens(n: int, device: str = "cpu") -> list[int]:
    """The demo's model and prompt decoded greedily here, eagerly, step by step."""
    dec = build_decoder("llama", "tiny", device, max_len=PROMPT + n + 8)
    with torch.no_grad():
        token = dec.prefill(dec.prompt(PROMPT))
        tokens = [int(token)]
        for i in range(n - 1):
            token = dec.step(token, dec.position(PROMPT + i))
            tokens.append(int(token))
    return tokens


def test_demo_quick_tokens_match_eager_and_one_capture_pair(tmp_path: Path) -> None:
    proc, doc = run_demo(tmp_path)
    ours = doc["runs"]["npugraph_ex"]["tokens"]
    assert ours == eager_tokens(doc["tokens"])
    assert doc["tokens_identical"] is True
    # the loop feeds each step's token back while still holding it: one capture, plus the one it
    # alternates with so that the held token is never overwritten
    assert doc["captures"] == 2
    assert "tokens identical to eager: yes" in proc.stdout
    # the per-token median starts after the last step that compiled or captured, as the counters
    # said step by step: the held-output capture (a later step than the first) is not in it
    run = doc["runs"]["npugraph_ex"]
    assert len(run["setup_steps"]) >= 2  # compile and first capture, then the second capture
    assert run["steady_from_step"] == max(run["setup_steps"]) + 1
    steady = run["step_s"][run["steady_from_step"] - 1:]
    assert steady and run["per_token_ms"] == statistics.median(steady) * 1e3
    assert doc["runs"]["eager"]["setup_steps"] == []
    assert f"steady from step {run['steady_from_step']}" in proc.stdout
    assert (tmp_path / "demo.png").stat().st_size > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_demo_quick_on_cuda_tokens_match_eager(tmp_path: Path) -> None:
    _, doc = run_demo(tmp_path, "--device", "cuda")
    assert doc["tokens_identical"] is True
    assert doc["captures"] >= 1


def test_demo_without_tqdm_and_matplotlib_prints_each_phase_and_says_png_skipped(
        tmp_path: Path) -> None:
    # A minimal install: None in sys.modules makes `import tqdm` / `import matplotlib` fail.
    script = ("import sys; sys.modules['tqdm'] = sys.modules['matplotlib'] = None; "
              "from npugraph_ex.demo import main; "
              f"sys.exit(main(['--quick', '--out', {str(tmp_path)!r}]))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "npugraph_ex: compile and capture ..." in lines
    assert any(ln.startswith("npugraph_ex: compile and capture done in ") for ln in lines)
    assert any(ln.startswith("npugraph_ex: decoded in ") for ln in lines)
    assert any(ln.startswith("demo.png skipped: matplotlib is not installed") for ln in lines)
    assert not (tmp_path / "demo.png").exists()
    assert json.loads((tmp_path / "demo.json").read_text())["tokens_identical"] is True


def test_steady_steps_begin_after_the_last_busy_step() -> None:
    from npugraph_ex.demo import steady_start

    assert steady_start([]) == 0
    assert steady_start([False, False]) == 0
    assert steady_start([True, False, True, False, False]) == 3  # a capture after a quiet step


def test_demo_device_choices_match_the_help() -> None:
    proc = subprocess.run([sys.executable, "-m", "npugraph_ex.cli", "demo", "--device", "tpu"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "allowed: cpu, cuda or npu" in proc.stderr
    from npugraph_ex.demo import parser

    assert "cpu, cuda or npu" in parser().format_help()
