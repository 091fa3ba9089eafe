"""What this machine offers npugraph-ex: versions, devices and the capabilities of each.

``doctor_report()`` returns plain data (JSON-serialisable); ``format_doctor(report)`` renders it.
``python -m npugraph_runtime doctor`` prints it; the meta-package's ``npugraph-ex doctor`` reuses
both. Nothing here raises for a missing or broken optional piece: it is reported instead."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from typing import Any

import torch

DISTRIBUTIONS = (
    "torch",
    "torch_npu",
    "transformers",
    "npugraph-runtime",
    "npugraph-passes",
    "npugraph-cache",
    "npugraph-backend",
    "npugraph-ex",
)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_entry() -> dict[str, Any]:
    entry: dict[str, Any] = {
        "device": "cpu",
        "name": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "intra_op_threads": torch.get_num_threads(),
    }
    try:
        from npugraph_runtime.devices import backend_for  # type: ignore[attr-defined]

        entry["capabilities"] = backend_for("cpu").capabilities(torch.device("cpu"))
    except Exception as e:  # a diagnostic reports, it does not stop
        entry["error"] = f"{type(e).__name__}: {e}"
    return entry


def _accelerator_entries(kind: str, problems: list[str]) -> list[dict[str, Any]]:
    from npugraph_runtime.devices.accelerator import AcceleratorBackend

    try:
        backend = AcceleratorBackend(kind)
    except Exception as e:
        problems.append(f"{kind}: {type(e).__name__}: {e}")
        return []
    entries: list[dict[str, Any]] = []
    for index in range(int(backend.module.device_count())):
        device = torch.device(kind, index)
        entry: dict[str, Any] = {"device": str(device)}
        try:
            entry["capabilities"] = backend.capabilities(device)
            entry["name"] = entry["capabilities"].get("name")
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {e}"
        entries.append(entry)
    return entries


def doctor_report() -> dict[str, Any]:
    """Versions of torch, torch_npu, transformers and our packages (None = not installed), the
    devices present (the CPU always) with their capabilities, and any problem found on the way."""
    problems: list[str] = []
    versions = {dist: _version(dist) for dist in DISTRIBUTIONS}
    versions["torch"] = torch.__version__
    devices = [_cpu_entry()]
    if torch.cuda.is_available():
        devices += _accelerator_entries("cuda", problems)
    elif torch.version.cuda is None:
        problems.append(f"cuda: this torch ({torch.__version__}) is built without CUDA")
    else:
        problems.append("cuda: torch has CUDA but sees no GPU (driver, CUDA_VISIBLE_DEVICES)")
    if importlib.util.find_spec("torch_npu") is not None:
        devices += _accelerator_entries("npu", problems)
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "executable": sys.executable,
        "versions": versions,
        "torch_cuda": torch.version.cuda,
        "devices": devices,
        "problems": problems,
    }


def _value(v: object) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and v >= 1 << 30:
        return f"{v / (1 << 30):.1f} GiB"
    return "-" if v is None else str(v)


def format_doctor(report: dict[str, Any]) -> str:
    """The report as aligned text, one section per device."""
    lines = [f"python      {report['python']}  ({report['platform']})"]
    for dist, version in report["versions"].items():
        lines.append(f"{dist:<18}{version or 'not installed'}")
    if report.get("torch_cuda"):
        lines.append(f"{'torch CUDA':<18}{report['torch_cuda']}")
    lines.append("")
    lines.append("devices")
    for entry in report["devices"]:
        title = entry["device"] + (f"  {entry['name']}" if entry.get("name") else "")
        lines.append(f"  {title}")
        for key in ("cpu_count", "intra_op_threads"):
            if key in entry:
                lines.append(f"    {key:<22}{entry[key]}")
        for key, value in entry.get("capabilities", {}).items():
            if key != "name":
                lines.append(f"    {key:<22}{_value(value)}")
        if "error" in entry:
            lines.append(f"    {'error':<22}{entry['error']}")
    if report["problems"]:
        lines.append("")
        lines.append("notes")
        lines.extend(f"  {p}" for p in report["problems"])
    return "\n".join(lines)


def report_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, default=str)
