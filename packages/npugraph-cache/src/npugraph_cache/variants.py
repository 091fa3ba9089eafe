"""Choosing among the variants of one cache key.

One key can hold several entries ("variants"): guards the key cannot see (an int dynamo
specialised, global state, the values of globals and module attributes) select among them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from npugraph_cache.entries import EntryReader
from npugraph_cache.guards import ValueGuards
from npugraph_cache.keys import CacheKey

__all__ = ["MAX_VARIANTS", "load_any"]

MAX_VARIANTS = 8


def load_any(
    reader: EntryReader, func_dir: Path, key: CacheKey, call_args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, ValueGuards, Path]:
    """(compiled, its value guards, its path) on a hit; (None, _, where to write) on a miss:
    a broken variant's file is reused, else the next free name."""
    digest = key.digest()
    broken: Path | None = None
    for variant in range(MAX_VARIANTS):
        path = reader.store.entry_path(func_dir, digest, variant)
        status, compiled, guards = reader.load(path, key, call_args, kwargs)
        if status == "hit":
            return compiled, guards, path
        if status == "missing":
            return None, reader.no_guards, broken or path
        if status == "broken" and broken is None:
            broken = path
    return None, reader.no_guards, broken or reader.store.entry_path(func_dir, digest, 0)
