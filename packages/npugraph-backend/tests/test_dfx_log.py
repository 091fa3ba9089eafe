"""The npugraph_ex logger: controlled by TORCH_LOGS, formats nothing when disabled."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
from npugraph_backend.dfx import log
from npugraph_passes import PassRecord


class _CountingName(str):
    """A pass name that counts how often it is formatted into a message."""

    formatted = 0

    def __str__(self) -> str:
        type(self).formatted += 1
        return str.__str__(self)


def _records() -> list[PassRecord]:
    return [PassRecord(_CountingName("remove_noop_ops"), 0.001, True, 10, 8)]


def test_pass_timings_are_not_formatted_when_the_level_is_disabled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _CountingName.formatted = 0
    with caplog.at_level(logging.WARNING, logger=log.LOGGER_NAME):
        log.log_pass_records("graph_0", _records())
    assert _CountingName.formatted == 0
    assert caplog.records == []


def test_pass_timings_are_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger=log.LOGGER_NAME):
        log.log_pass_records("graph_0", _records())
    messages = [r.getMessage() for r in caplog.records]
    assert any("pass remove_noop_ops took" in m and "changed the graph" in m for m in messages)
    assert any("1 passes took" in m for m in messages)


def test_torch_logs_turns_the_logger_on() -> None:
    code = textwrap.dedent(
        """
        import logging
        import torch
        from npugraph_backend.dfx import log
        log.ensure_registered()
        from npugraph_passes import PassRecord
        log.log_pass_records("graph_7", [PassRecord("inplace_pass", 0.002, False, 5, 5)])
        print(logging.getLogger("npugraph_ex").getEffectiveLevel())
        """
    )
    env = {**os.environ, "TORCH_LOGS": "+npugraph_ex"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(logging.DEBUG)
    assert "graph_7: pass inplace_pass took" in proc.stderr
