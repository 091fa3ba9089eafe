"""``python -m npugraph_runtime doctor``: versions, devices and capabilities."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from npugraph_runtime.__main__ import main
from npugraph_runtime.doctor import doctor_report, format_doctor


def test_doctor_command_prints_versions_and_the_cpu() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "npugraph_runtime", "doctor"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert torch.__version__ in out
    for name in ("torch_npu", "transformers", "npugraph-runtime"):
        assert name in out
    assert "\n  cpu" in out
    assert "core_limit" in out


def test_report_lists_the_cpu_with_its_capabilities() -> None:
    report = doctor_report()
    assert report["versions"]["torch"] == torch.__version__
    cpu = report["devices"][0]
    assert cpu["device"] == "cpu"
    assert "error" not in cpu, cpu.get("error")
    assert cpu["capabilities"]["core_limit"]
    assert cpu["intra_op_threads"] == torch.get_num_threads()


def test_report_lists_every_gpu_or_says_why_there_is_none() -> None:
    report = doctor_report()
    gpus = [d for d in report["devices"] if d["device"].startswith("cuda")]
    if torch.cuda.is_available():
        assert len(gpus) == torch.cuda.device_count()
        assert all(g["capabilities"]["graphs"] is True for g in gpus)
    else:
        assert gpus == []
        assert any(p.startswith("cuda:") for p in report["problems"])


def test_missing_optional_packages_are_reported_as_not_installed() -> None:
    report = doctor_report()
    text = format_doctor(report)
    for dist, version in report["versions"].items():
        assert dist in text
        if version is None:
            assert f"{dist}" in text and "not installed" in text


def test_json_output_is_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["versions"]["torch"] == torch.__version__
    assert printed["devices"][0]["device"] == "cpu"
