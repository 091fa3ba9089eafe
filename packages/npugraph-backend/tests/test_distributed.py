"""Collectives inside captured graphs, on 2 gloo ranks on 127.0.0.1 (dist_worker.py is one rank).

One pair of processes runs every collective scenario (20 calls with fresh inputs each, rank 1
arriving late on every call); the tests below read its per-rank results. Fault tests start their
own pair with a 5 s process-group timeout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

WORKER = Path(__file__).with_name("dist_worker.py")
RANKS = (0, 1)
WAIT_S = 150  # the whole collective suite; a fault run is bounded by FAULT_WAIT_S
FAULT_WAIT_S = 60


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(suite: str, tmp: Path) -> list[tuple[subprocess.Popen[bytes], Path]]:
    env = {**os.environ, "NPUGRAPH_TEST_PORT2": str(_port()), "OMP_NUM_THREADS": "1",
           "TORCH_COMPILE_DEBUG_DIR": str(tmp / "debug")}
    env.pop("TORCH_COMPILE_DEBUG", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    port = str(_port())
    procs = []
    for rank in RANKS:
        out = tmp / f"{suite}_rank{rank}.json"
        proc = subprocess.Popen([sys.executable, str(WORKER), str(rank), port, str(out), suite],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        procs.append((proc, out))
    return procs


def _result(proc: subprocess.Popen[bytes], out: Path, wait_s: float) -> dict[str, Any]:
    try:
        _, err = proc.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"rank hung for {wait_s} s: {err.decode()[-2000:]}")
    if not out.exists():
        pytest.fail(f"rank wrote no result (exit {proc.returncode}): {err.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    assert "crash" not in result, result["crash"]
    return result


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    procs = _start("collectives", tmp_path_factory.mktemp("dist"))
    return [_result(proc, out, WAIT_S) for proc, out in procs]


CAPTURED = [
    "fc_all_reduce", "dist_all_reduce", "fc_all_reduce_chain", "fc_all_gather", "dist_all_gather",
    "fc_reduce_scatter", "dist_reduce_scatter", "fc_all_to_all_even", "fc_all_to_all_uneven",
    "dist_all_to_all_uneven", "fc_broadcast", "tp_mlp",
    "fc_all_reduce/inplace_pass=False", "dist_all_reduce/inplace_pass=False",
    "tp_mlp/inplace_pass=False", "hand_capture_dist_all_reduce",
]


@pytest.mark.parametrize("scenario", CAPTURED)
def test_collective_replays_equal_eager_on_every_rank(suite: list[dict[str, Any]], scenario: str) -> None:
    for rank, results in zip(RANKS, suite, strict=True):
        r = results[scenario]
        assert "crash" not in r, r["crash"]
        assert r["captured"] == 1 and r["fallbacks"] == 0, (rank, r)
        assert r["calls"] >= 21 and r["bad"] == 0, (rank, r)  # >= 20 replays


@pytest.mark.parametrize("scenario", ["dist_broadcast", "send_recv"])
def test_untraced_collective_between_captured_graphs(suite: list[dict[str, Any]], scenario: str) -> None:
    # dynamo breaks the graph at dist.broadcast and send/recv: two captured graphs around them
    for rank, results in zip(RANKS, suite, strict=True):
        r = results[scenario]
        assert "crash" not in r, r["crash"]
        assert r["captured"] == 2 and r["fallbacks"] == 0, (rank, r)
        assert r["bad"] == 0, (rank, r)


def test_data_dump_and_debug_folders_per_rank(suite: list[dict[str, Any]]) -> None:
    for rank, results in zip(RANKS, suite, strict=True):
        assert "crash" not in results["dumps"], results["dumps"]["crash"]
        assert results["dumps"]["dump_dirs"] == [f"worldsize2_global_rank{rank}"]
        # both ranks wrote into one TORCH_COMPILE_DEBUG_DIR: one run folder each, named by rank
        assert results["dumps"]["debug_dirs"] == ["rank_0", "rank_1"]


def test_graph_called_under_another_process_group_is_refused(suite: list[dict[str, Any]]) -> None:
    for results in suite:
        r = results["changed_group"]
        assert "crash" not in r, r["crash"]
        assert r["error"] == "ProcessGroupChangedError", r
        assert "process group '0'" in r["message"] and "Compile again" in r["message"]


@pytest.mark.parametrize(("how", "captured"), [("dead_peer", 1), ("timeout", 1),
                                               ("capture_timeout", 0)])
def test_lost_peer_during_capture_or_replay_is_an_error_not_a_hang(
        tmp_path: Path, how: str, captured: int) -> None:
    start = time.monotonic()
    (proc0, out0), (proc1, _) = _start(how, tmp_path)
    try:
        r = _result(proc0, out0, FAULT_WAIT_S)
    finally:
        proc1.kill()
        proc1.communicate()
    assert r["error"] is not None, r
    assert r["captured"] == captured, r  # 1: failed in a replay; 0: the capture failed
    assert r["seconds"] < 5 * 3, r  # within a few process-group timeouts (5 s)
    assert time.monotonic() - start < FAULT_WAIT_S


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2
                    or not dist.is_nccl_available(), reason="needs 2 NVIDIA GPUs and NCCL")
def test_nccl_collectives_replay_inside_cuda_graphs(tmp_path: Path) -> None:
    procs = _start("nccl", tmp_path)
    for rank, (proc, out) in zip(RANKS, procs, strict=True):
        results = _result(proc, out, WAIT_S)
        for scenario in CAPTURED:
            if "/" in scenario or scenario.startswith("hand_"):
                continue
            r = results[scenario]
            assert "crash" not in r, (rank, scenario, r["crash"])
            assert r["captured"] == 1 and r["fallbacks"] == 0 and r["bad"] == 0, (rank, scenario, r)
