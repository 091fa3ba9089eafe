"""npugraph_ex.inference.cache_compile of a module holding npugraph_runtime streams and events
(and one holding torch.Stream / torch.Event objects), across processes: a stream's label names a stream of the graph (its value differs in every
process), so a process whose streams alias as the entry's did loads it, and one where they do
not (one stream object for both) compiles its own; every process equals eager over 6 calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from npugraph_cache import _compat
from npugraph_cache.secret import KEY_ENV

WORKER = Path(__file__).with_name("streams_worker.py")
pytestmark = pytest.mark.skipif(not _compat.has_aot_compile(),
                                reason=f"torch {torch.__version__}: no disk cache (no aot_compile)")


@pytest.fixture(autouse=True)
def own_cache_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "cache.key"))
    yield


def _process(cache: Path, out: Path, mode: str) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(WORKER), str(cache), str(out), mode],
                   env=env, check=True, timeout=240)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_a_process_whose_streams_have_other_labels_loads_the_entry(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _process(cache, tmp_path / "first.json", "other-first")
    assert first["cache"] == {"compiled": 1} and first["max_error"] == 0.0
    assert first["captures"] >= 1 and first["warnings"] == []
    second = _process(cache, tmp_path / "second.json", "plain")
    assert second["labels"] != first["labels"]  # other labels, the same aliasing
    assert second["cache"] == {"loaded": 1}, second["warnings"]
    assert second["captures"] >= 1 and second["max_error"] == 0.0
    assert second["warnings"] == []


@pytest.mark.parametrize("kind", ["", "torch-"], ids=["npugraph_runtime", "torch"])
def test_one_stream_for_both_does_not_load_an_entry_made_with_two(tmp_path: Path, kind: str) -> None:
    cache = tmp_path / "cache"
    _process(cache, tmp_path / "first.json", f"{kind}plain")
    same = _process(cache, tmp_path / "same.json", f"{kind}same")
    assert same["cache"] == {"rejected": 1, "compiled": 1}
    assert same["max_error"] == 0.0 and same["captures"] >= 1
    [warning] = same["warnings"]
    assert "used are [self.s0 = self.s1], " in warning and "were [self.s0], [self.s1]" in warning
    again = _process(cache, tmp_path / "again.json", f"{kind}same")  # its own entry, loaded
    assert again["cache"] == {"loaded": 1} and again["max_error"] == 0.0
    two = _process(cache, tmp_path / "two.json", f"{kind}plain")  # and the first one's
    assert two["cache"] == {"loaded": 1} and two["max_error"] == 0.0


# torch's own streams and events (torch.Stream / torch.Event; torch.npu.Stream / torch.cuda.Stream
# on a device). torch saves a stream as a placeholder whose loaded type check never passes, and
# cannot save an event: their TYPE_MATCH is dropped from torch's tree and re-checked by
# npugraph_cache.guards (the type, and the aliasing pattern by identity)


def test_a_module_holding_torch_streams_and_events_is_loaded_by_a_new_process(
        tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _process(cache, tmp_path / "first.json", "torch-plain")
    assert first["cache"] == {"compiled": 1} and first["max_error"] == 0.0
    assert first["captures"] >= 1 and first["warnings"] == []
    # this process compiled a torch-stream graph of its own first (the same graph number)
    second = _process(cache, tmp_path / "second.json", "torch-other-first")
    assert second["cache"] == {"loaded": 1}, second["warnings"]
    assert second["captures"] >= 1 and second["max_error"] == 0.0
    assert second["warnings"] == []


def test_a_global_torch_stream_is_loaded_by_a_new_process(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _process(cache, tmp_path / "first.json", "torch-global")
    assert first["cache"] == {"compiled": 1} and first["max_error"] == 0.0
    second = _process(cache, tmp_path / "second.json", "torch-global")
    assert second["cache"] == {"loaded": 1}, second["warnings"]
    assert second["captures"] >= 1 and second["max_error"] == 0.0


@pytest.mark.parametrize("mode", ["torch-swap", "torch-global-swap"])
def test_torch_streams_made_one_in_the_running_process_are_not_served_the_old_graph(
        tmp_path: Path, mode: str) -> None:
    swap = _process(tmp_path / "cache", tmp_path / "swap.json", mode)
    assert swap["cache"] == {"compiled": 2, "rejected": 1}
    assert swap["max_error"] == 0.0 and swap["captures"] >= 2
    [warning] = swap["warnings"]
    assert "[self.s0 = self.s1]" in warning or "[G['SIDE'] = self.s0]" in warning, warning
