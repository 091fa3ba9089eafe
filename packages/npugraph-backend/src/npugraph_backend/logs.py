"""The "npugraph_ex" logger, registered with torch's logging so ``TORCH_LOGS=+npugraph_ex`` works."""

from __future__ import annotations

import logging

from npugraph_backend import _compat

LOGGER_NAME = "npugraph_ex"

log = logging.getLogger(LOGGER_NAME)

_compat.register_log(LOGGER_NAME)
