"""The npugraph_ex logger: TORCH_LOGS turns it on; replays log nothing."""

from __future__ import annotations

import logging

import pytest
import torch
from npugraph_backend.dfx import log
from npugraph_runtime import make_graphed_callable


def test_replays_emit_no_log_records(caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 8)
    with torch.no_grad(), caplog.at_level(logging.DEBUG, logger=log.LOGGER_NAME):
        graphed = make_graphed_callable(model, (x,))
        graphed(x)
        captured = len(caplog.records)
        for _ in range(3):
            y = torch.randn(2, 8)
            torch.testing.assert_close(graphed(y), model(y))
    assert captured >= 1  # the capture itself is logged
    assert len(caplog.records) == captured
