"""Debug-file logging for TORCH_COMPILE_DEBUG. The ``npugraph_ex`` logger itself, registered with
torch's logging registry (``TORCH_LOGS=+npugraph_ex``), lives in ``npugraph_backend.logs``;
this module reuses it.

Messages use %-style arguments so nothing is formatted unless the level is enabled; anything
costlier is guarded with ``logger.isEnabledFor``. Nothing here runs on the replay path."""

from __future__ import annotations

import logging
import threading

from npugraph_backend.logs import LOGGER_NAME
from npugraph_backend.logs import log as logger

__all__ = ["LOGGER_NAME", "attach_debug_file", "logger"]

_file_handlers: dict[str, logging.FileHandler] = {}
_lock = threading.Lock()


def attach_debug_file(path: str) -> None:
    """Sends every record of the logger, DEBUG included, to ``path`` (once per path) and lowers
    the logger to DEBUG, as TORCH_COMPILE_DEBUG asks."""
    with _lock:
        if path in _file_handlers:
            return
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.setLevel(logging.DEBUG)
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s %(filename)s:%(lineno)d] %(message)s")
        )
        logger.addHandler(handler)
        _file_handlers[path] = handler
        if logger.getEffectiveLevel() > logging.DEBUG:
            logger.setLevel(logging.DEBUG)
