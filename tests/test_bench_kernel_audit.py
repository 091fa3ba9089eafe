"""Bench (h), the per-op kernel audit, runs and lists ops with both timings; bench (c) refuses a
decode case it does not know, naming it (timings are reported by the bench, never judged here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def test_bench_quick_section_h_lists_audited_ops(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "npugraph_ex.cli", "bench", "--quick", "--only", "h",
         "--no-progress", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    section = json.loads((tmp_path / "bench.json").read_text())["sections"]["h"]
    assert section["error"] == ""
    ops = section["data"]["llama-tiny-b8"]["ops"]
    assert ops and all(o["replay_s"] > 0 and o["eager_s"] > 0 for o in ops)
    assert {"aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu"} <= {o["op"] for o in ops}
    names = [f["name"] for f in section["figures"]]
    assert "llama-tiny-b8: op kinds slower than eager" in names


def test_bench_c_refuses_an_unknown_decode_case(tmp_path: Path) -> None:
    from npugraph_ex.bench.context import BenchContext
    from npugraph_ex.bench.decode import cases_for

    ctx = BenchContext(device=torch.device("cpu"), out=tmp_path, decode_cases=("llama-huge",))
    with pytest.raises(ValueError, match="llama-huge"):
        cases_for(ctx, ("llama", "gpt2"))
    ctx.decode_cases = ("llama-medium-b8",)
    assert cases_for(ctx, ("llama", "gpt2")) == [("llama", "medium", 8)]
