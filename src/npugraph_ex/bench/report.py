"""Figures, sections and how a run is written out: a printed table, bench.json and bench.png."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

Status = Literal["PASS", "MISS", "INFO", "SKIP"]


@dataclass
class Figure:
    """One reported number. `target` is the text of the goal (empty for information only);
    `status` is PASS or MISS when there is a target, INFO when not, SKIP when not measured."""

    name: str
    value: float | None
    unit: str
    target: str = ""
    status: Status = "INFO"
    note: str = ""

    @classmethod
    def check(cls, name: str, value: float, unit: str, target: str, ok: bool, note: str = "") -> Figure:
        return cls(name, value, unit, target, "PASS" if ok else "MISS", note)

    @classmethod
    def skip(cls, name: str, note: str, target: str = "") -> Figure:
        return cls(name, None, "", target, "SKIP", note)


@dataclass
class Section:
    """One benchmark's result: figures plus the raw numbers it measured (`data`) and bar groups
    to plot (`bars`: title -> label -> value, all in `bar_unit`)."""

    key: str
    title: str
    figures: list[Figure] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    bars: dict[str, dict[str, float]] = field(default_factory=dict)
    bar_unit: str = ""
    seconds: float = 0.0
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "seconds": round(self.seconds, 2),
            "error": self.error,
            "figures": [f.__dict__ for f in self.figures],
            "data": self.data,
            "bars": self.bars,
            "bar_unit": self.bar_unit,
        }


def git_commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    commit = out.stdout.strip()
    if not commit:
        return "unknown"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True,
        text=True, timeout=10,
    ).stdout.strip()
    return commit + ("-dirty" if dirty else "")


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_commit": git_commit(),
        "argv": sys.argv[1:],
    }
    with contextlib.suppress(AttributeError):
        env["affinity_cores"] = len(os.sched_getaffinity(0))
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    for mod in ("npugraph_ex", "npugraph_runtime", "npugraph_backend", "npugraph_passes",
                "npugraph_cache"):
        try:
            env[mod] = __import__(mod).__version__
        except (ImportError, AttributeError):
            env[mod] = None
    return env


def format_value(f: Figure) -> str:
    if f.value is None:
        return "-"
    v = f.value
    text = f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return f"{text} {f.unit}".strip()


def print_table(sections: list[Section], file: Any = None) -> None:
    out = file or sys.stdout
    for s in sections:
        print(f"\n== ({s.key}) {s.title}  [{s.seconds:.1f} s]", file=out)
        if s.error:
            print(f"   ERROR: {s.error}", file=out)
        for f in s.figures:
            target = f"target {f.target}" if f.target else ""
            note = f"  ({f.note})" if f.note else ""
            print(f"   {f.status:4}  {f.name:<52} {format_value(f):>14}  {target}{note}", file=out)


def write_json(path: Path, env: dict[str, Any], sections: list[Section]) -> None:
    summary = {st: sum(f.status == st for s in sections for f in s.figures)
               for st in ("PASS", "MISS", "INFO", "SKIP")}
    doc = {"environment": env, "summary": summary,
           "sections": {s.key: s.as_dict() for s in sections}}
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def plot(path: Path, sections: list[Section], title: str) -> bool:
    """One horizontal bar chart per bar group. Returns False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = [(s, name, bars) for s in sections for name, bars in s.bars.items() if bars]
    n = max(1, len(groups))
    cols = 2 if n > 1 else 1
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 2.2 + 0.9 * rows * 3), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.axis("off")
    for ax, (s, name, bars) in zip(axes.flat, groups, strict=False):
        labels = list(bars)
        values = [bars[k] for k in labels]
        colors = ["tab:orange" if "ours" in k or "npugraph" in k else "tab:blue" for k in labels]
        ax.barh(labels, values, color=colors)
        ax.invert_yaxis()
        ax.set_title(f"({s.key}) {name}", fontsize=9)
        ax.set_xlabel(s.bar_unit, fontsize=8)
        ax.tick_params(labelsize=7)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:,.0f}" if abs(v) >= 100 else f" {v:.3g}", va="center", fontsize=7)
    fig.suptitle(f"{title}   (orange: npugraph_ex)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
