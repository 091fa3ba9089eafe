"""A call issues each collective once when its CPU capture is made again because fn reads an
input through as_strided (2 gloo ranks on 127.0.0.1; collectives_once_strided_worker.py is one
rank).

The first capture that finds such a read is discarded and made again with a buffer mirroring
the input's storage. Its first run stopped launching at the read, but the collectives it issued
before the read were launched again by the capture made again: on the rank that read through
as_strided the call issued them twice, so the ranks went out of step (wrong sums, then a gloo
abort), and an in-place all_reduce was applied twice on that rank."""

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

WORKER = Path(__file__).with_name("collectives_once_strided_worker.py")
WAIT_S = 90


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("collectives_once_strided")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    outs = [tmp / f"{r}.json" for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), port, str(out)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for r, out in enumerate(outs)]
    try:
        errs = [p.communicate(timeout=WAIT_S)[1] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"a rank hung for {WAIT_S} s")
    for out, err in zip(outs, errs, strict=True):
        if not out.exists():
            pytest.fail(f"a rank wrote no result: {err.decode()[-2000:]}")
    return [json.loads(out.read_text()) for out in outs]


def _check(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    results = [r.get(name, {"crash": "not run (an earlier scenario crashed)"}) for r in ranks]
    for rank, res in enumerate(results):
        assert "crash" not in res, f"rank {rank}: {res['crash']}"
        assert res["counts"] == res["eager_counts"], (
            f"rank {rank} issued these collectives per call, eager {res['eager_counts']}: {res}")
        assert res["bad"] == [] and res["stale"] == [], f"rank {rank} differs from eager: {res}"
    return results


def test_a_functional_fn_reading_through_as_strided_on_one_rank_on_new_keys(
    ranks: list[dict[str, Any]],
) -> None:
    strided, plain = _check(ranks, "functional_new_keys")
    assert strided["captures"] == 6 and plain["events"] == ["new_key"], (strided, plain)


def test_held_outputs_on_the_rank_reading_through_as_strided(ranks: list[dict[str, Any]]) -> None:
    strided, plain = _check(ranks, "functional_same_key_held")
    assert "held_outputs" in strided["events"], strided
    assert plain["events"] == ["new_key"], plain


def test_a_functional_collective_before_the_read_keeps_its_value(
    ranks: list[dict[str, Any]],
) -> None:
    # the capture made again takes the functional all_reduce's result from the first run
    strided, plain = _check(ranks, "functional_op_before")
    assert strided["captures"] == 6 and plain["captures"] == 1, (strided, plain)


def test_by_hand_with_held_outputs_and_without_warmup(ranks: list[dict[str, Any]]) -> None:
    held, _ = _check(ranks, "by_hand_held")
    assert "held_outputs" in held["events"], held
    moving, staying = _check(ranks, "by_hand_warmup_0")
    assert moving["captures"] == 6 and staying["captures"] == 1, (moving, staying)


def test_both_ranks_reading_through_as_strided(ranks: list[dict[str, Any]]) -> None:
    for res in _check(ranks, "both_ranks_strided"):
        assert res["events"][0] == "new_key", res


def test_relaxed_mode_refuses_freezing_a_value_a_collective_only_stood_in_for(
    ranks: list[dict[str, Any]],
) -> None:
    # it froze this rank's own value: replays multiplied by 1 instead of the world size
    for rank, res in enumerate(ranks):
        res = res["relaxed_host_read"]
        for path, error in res["errors"].items():
            assert "capture_error_mode='relaxed'" in error, (rank, path, error)
            assert "_local_scalar_dense" in error and "Move the host read out" in error, error
        # the warm-ups issued one (warmup=0 none: its call raised before anything ran), the
        # functional fn's calls one each
        assert res["counts"] == [1, 0, 1] + [1] * (len(res["counts"]) - 3), res
        assert res["bad"] == [] and res["captures"] >= 1, res
