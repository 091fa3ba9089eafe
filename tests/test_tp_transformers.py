"""transformers' own tensor-parallel plan (``tp_plan="auto"``) on 2 gloo ranks on 127.0.0.1,
compiled with backend="npugraph_ex": every rank decodes the single-process model's tokens.
transformers loads a tp_plan only through accelerate (in the dev extra, installed beside the
pinned torch); the test skips where it is missing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WORKER = Path(__file__).with_name("tp_hf_worker.py")
TOKENS = 8


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_transformers_tp_plan_on_gloo_decodes_single_process_tokens(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    port = str(_port())
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(rank), port, str(tmp_path / "model"),
                          str(tmp_path / f"rank{rank}.json"), str(TOKENS)],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for rank in (0, 1)
    ]
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"rank {rank} hung")
        out = tmp_path / f"rank{rank}.json"
        assert out.exists(), f"rank {rank} wrote no result: {err.decode()[-2000:]}"
        r = json.loads(out.read_text())
        assert "crash" not in r, r["crash"]
        # one capture, and one more of the same key: the loop holds the last logits
        assert r["captured"] == 2 and r["held_output_captures"] == 1, r
        assert r["fallbacks"] == 0, r
        assert r["eager_tp"] == r["single"] and r["ours_tp"] == r["single"], r
