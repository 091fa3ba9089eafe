"""`npugraph-ex bench --quick` runs a small benchmark and writes valid JSON (timings are not
checked here: benchmarks report them, tests never judge them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ENV_KEYS = {"torch", "python", "device", "git_commit", "cores"}


def test_bench_quick_section_a_writes_json_with_environment_and_figures(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "npugraph_ex.cli", "bench", "--quick", "--only", "a",
         "--no-progress", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert set(doc["environment"]) >= ENV_KEYS
    assert list(doc["sections"]) == ["a"]
    section = doc["sections"]["a"]
    assert section["error"] == ""
    figures = {f["name"]: f for f in section["figures"]}
    ours = figures["ours: overhead over bare replay"]
    assert ours["status"] in ("PASS", "MISS"), ours["note"]
    assert isinstance(ours["value"], float)
    for start in ("cold", "warm"):
        serving = figures[f"ours: serving path (cache_compile, {start}) over bare replay"]
        assert serving["status"] in ("PASS", "MISS"), serving["note"]
    assert figures["aot_eager overhead over its GraphModule"]["value"] is not None
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_bench_refuses_an_unknown_section() -> None:
    from npugraph_ex.bench import selected

    with pytest.raises(SystemExit, match="unknown section"):
        selected("a,z")
