"""deadlock_check: the multi-stream task graph of a compiled graph, its JSON report and log."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import npugraph_runtime as ngr
import pytest
import torch
from npugraph_backend.dfx import deadlock
from npugraph_backend.dfx.deadlock import DeadlockRiskWarning, Task

SIDE = ngr.Stream("cpu")


def _compile(fn: object, tmp_path: Path) -> object:
    options = {"deadlock_check": True, "data_dump_dir": str(tmp_path)}
    return torch.compile(fn, backend="npugraph_ex", fullgraph=True, options=options)


def _reports(tmp_path: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted(tmp_path.rglob("*_deadlock_check.json"))]


def test_clean_two_stream_graph_logs_no_risk_and_writes_a_report(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        with ngr.stream(SIDE):
            y = x.exp()
            e = ngr.Event("cpu")
            e.record()
        e.wait()
        return y + 1

    compiled = _compile(fn, tmp_path)
    with caplog.at_level(logging.INFO, logger="npugraph_ex"), warnings.catch_warnings():
        warnings.simplefilter("error", DeadlockRiskWarning)
        x = torch.randn(4)
        torch.testing.assert_close(compiled(x), fn(x))  # type: ignore[operator]
    assert deadlock.CLEAN in caplog.text
    (report,) = _reports(tmp_path)
    assert report["clean"] is True
    assert report["wait_cycles"] == [] and report["unrecorded_waits"] == []
    streams = report["streams"]
    assert isinstance(streams, dict) and set(streams) == {"None", SIDE.label}


def test_constructed_wait_cycle_is_reported_naming_the_nodes(tmp_path: Path) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        ex = torch.ops.npugraph_ex
        ex.scope_enter(["_user_stream_label"], [SIDE.label])
        ex.event_wait("cycle_a", "cpu")  # the side stream waits for a record the default
        y = x * 2                        # stream only makes after waiting for the side stream
        ex.event_record("cycle_b", "cpu")
        ex.scope_exit()
        ex.event_wait("cycle_b", "cpu")
        ex.event_record("cycle_a", "cpu")
        ex.event_wait("never_recorded", "cpu")
        return y + 1

    compiled = _compile(fn, tmp_path)
    with pytest.warns(DeadlockRiskWarning, match="wait cycles .*event_wait.*never recorded"):
        compiled(torch.randn(3))  # type: ignore[operator]
    (report,) = _reports(tmp_path)
    assert report["clean"] is False
    (cycle,) = report["wait_cycles"]  # type: ignore[misc]
    assert any(name.startswith("event_wait") for name in cycle)
    assert any(name.startswith("event_record") for name in cycle)
    assert len(report["unrecorded_waits"]) == 1  # type: ignore[arg-type]


def test_concurrent_communication_over_the_core_budget_is_a_conflict() -> None:
    tasks = [
        Task("fork", None, "record", "f"),
        Task("wait_fork", "side", "wait", "f"),
        Task("all_reduce_side", "side", "comm", demand=3),
        Task("all_reduce_main", None, "comm", demand=2),
        Task("join", "side", "record", "j"),
        Task("wait_join", None, "wait", "j"),
        Task("all_gather_after_join", None, "comm", demand=4),
    ]
    report = deadlock.check(tasks, total_cores=4)
    assert [sorted(c["tasks"]) for c in report.comm_conflicts] == [["all_reduce_main", "all_reduce_side"]]  # type: ignore[call-overload]
    assert deadlock.check(tasks, total_cores=8).clean
