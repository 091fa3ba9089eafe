"""A captured call issues each collective of fn exactly once, as eager does, on every path of the
capture manager (2 gloo ranks on 127.0.0.1; collectives_once_worker.py is one rank).

On the CPU a capture runs the ops it records. A capture whose run was not the call's (a hand-
written fn's new key after its warm-up, warmup=0, force_recapture) used to issue fn's collectives
during the capture as well, and a later capture of a fn that writes a tensor besides its inputs
ran again eagerly after the capture: a rank issued them twice in one call. When that happens on
one rank only (ranks taking different keys, holding outputs on one rank) the ranks go out of step
and compute wrong sums; when it happens on both, each call costs twice the communication. Extra
warmup runs issued them too, on every device."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

WORKER = Path(__file__).with_name("collectives_once_worker.py")
WAIT_S = 90


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("collectives_once")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    port = str(_port())
    procs = [(subprocess.Popen([sys.executable, str(WORKER), str(r), port, str(tmp / f"{r}.json")],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
              tmp / f"{r}.json") for r in (0, 1)]
    results = []
    for proc, out in procs:
        try:
            _, err = proc.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            pytest.fail(f"a rank hung for {WAIT_S} s")
        if not out.exists():
            pytest.fail(f"rank wrote no result (exit {proc.returncode}): {err.decode()[-2000:]}")
        results.append(json.loads(out.read_text()))
    return results


def _check(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    results = [r.get(name, {"crash": "not run (an earlier scenario crashed)"}) for r in ranks]
    for rank, res in enumerate(results):
        assert "crash" not in res, f"rank {rank}: {res['crash']}"
        assert res["counts"] == [1] * len(res["counts"]), (
            f"rank {rank} issued these collectives per call (eager: 1): {res}")
        assert res["bad"] == [] and res["stale"] == [], f"rank {rank} differs from eager: {res}"
    return results


def test_new_keys_on_one_rank(ranks: list[dict[str, Any]]) -> None:
    # the warm-up was the call's run; the capture after it issued fn's collective again
    moving, staying = _check(ranks, "new_keys_on_one_rank")
    assert moving["captures"] == 6 and staying["captures"] == 1, (moving, staying)


def test_new_keys_on_one_rank_without_warmup(ranks: list[dict[str, Any]]) -> None:
    # the capture, then the replay that is the call
    moving, staying = _check(ranks, "new_keys_on_one_rank_warmup_0")
    assert moving["captures"] == 6 and staying["captures"] == 1, (moving, staying)


def test_new_keys_on_one_rank_with_extra_warmups(ranks: list[dict[str, Any]]) -> None:
    # the warm-up runs before the last one issued it too (they are undone, their collectives
    # were not)
    moving, staying = _check(ranks, "new_keys_on_one_rank_warmup_3")
    assert moving["captures"] == 6 and staying["captures"] == 1, (moving, staying)


def test_outputs_held_on_one_rank_by_a_fn_writing_besides_its_inputs(
    ranks: list[dict[str, Any]],
) -> None:
    # the held-outputs capture wrote fn's step counter, so it was undone and the call ran again
    held, dropped = _check(ranks, "held_outputs_on_one_rank")
    assert "held_outputs" in held["events"], held
    assert dropped["events"] == ["new_key"], dropped


def test_force_recapture(ranks: list[dict[str, Any]]) -> None:
    for res in _check(ranks, "force_recapture"):
        assert res["events"].count("force_recapture") == 5, res


def test_capture_limit_reached_on_one_rank(ranks: list[dict[str, Any]]) -> None:
    moving, staying = _check(ranks, "capture_limit_reached_on_one_rank")
    assert moving["events"] == ["new_key", "new_key"], moving  # then eager
    assert staying["captures"] == 1, staying


def test_clone_input_false(ranks: list[dict[str, Any]]) -> None:
    moving, staying = _check(ranks, "clone_input_false")
    assert moving["captures"] == 6 and staying["captures"] == 1, (moving, staying)


def test_a_first_capture_made_again_for_an_as_strided_read(ranks: list[dict[str, Any]]) -> None:
    # the capture is made again with a buffer mirroring x's storage: the run to be discarded
    # launched fn's collective too
    held, dropped = _check(ranks, "as_strided_held_outputs_on_one_rank")
    assert "held_outputs" in held["events"], held
    assert dropped["events"] == ["new_key"], dropped
    # a functional fn's new key is captured as the call's own run: the discarded first run
    # stopped launching at its as_strided read
    moving, staying = _check(ranks, "as_strided_functional")
    assert moving["captures"] == 6 and staying["events"] == ["new_key"], (moving, staying)
