"""`npugraph-ex demo` as the README runs it: a subprocess whose tokens must equal eager's."""

from __future__ import annotations

import json
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
    assert (tmp_path / "demo.png").stat().st_size > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_demo_quick_on_cuda_tokens_match_eager(tmp_path: Path) -> None:
    _, doc = run_demo(tmp_path, "--device", "cuda")
    assert doc["tokens_identical"] is True
    assert doc["captures"] >= 1
