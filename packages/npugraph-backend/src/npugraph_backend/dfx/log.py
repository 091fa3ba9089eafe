"""The ``npugraph_ex`` logger, registered with torch's logging registry so that
``TORCH_LOGS=+npugraph_ex`` and ``torch._logging.set_logs(npugraph_ex=logging.DEBUG)`` control it.

Messages use %-style arguments so nothing is formatted unless the level is enabled; anything
costlier than that is guarded with ``logger.isEnabledFor``. Nothing here runs on the replay path."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

from npugraph_backend import _compat

LOGGER_NAME = "npugraph_ex"

logger = logging.getLogger(LOGGER_NAME)

_registered = False
_file_handlers: dict[str, logging.FileHandler] = {}
_lock = threading.Lock()


def ensure_registered() -> logging.Logger:
    """Registers the logger with torch's logging registry once (shared with the backend, which
    may already have done it) and returns it."""
    global _registered
    if not _registered:
        _compat.register_log(LOGGER_NAME)
        _registered = True
    return logger


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


class _PassRecordLike(Protocol):
    name: str
    seconds: float
    changed: bool
    nodes_before: int
    nodes_after: int


def log_pass_records(graph_name: str, records: Sequence[_PassRecordLike]) -> None:
    """One DEBUG line per pass (time, whether it changed the graph, node counts) and an INFO
    total. Formats nothing when neither level is enabled."""
    if not logger.isEnabledFor(logging.INFO):
        return
    total = 0.0
    for r in records:
        total += r.seconds
        logger.debug(
            "%s: pass %s took %.3f ms, %s (%d -> %d nodes)",
            graph_name, r.name, r.seconds * 1e3,
            "changed the graph" if r.changed else "no change", r.nodes_before, r.nodes_after,
        )
    logger.info("%s: %d passes took %.3f ms", graph_name, len(records), total * 1e3)
