"""Reading one entry of the disk cache: authenticating it, checking that it still fits, loading it.

Nothing is unpickled unless the entry's tag verifies with the user's key, its key matches and the
values of the globals and attributes it read are unchanged. A rejected entry warns once per
lookup, though a lookup reads it twice (before and after taking the folder's lock)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from npugraph_cache import _compat
from npugraph_cache.errors import CacheEntryError, CacheWarning, FormatError
from npugraph_cache.guards import ValueGuards
from npugraph_cache.keys import CacheKey
from npugraph_cache.store import CacheStore

__all__ = ["COUNTERS", "EntryReader", "Status", "bump"]

COUNTERS = "npugraph_ex_cache"
log = logging.getLogger("npugraph_ex")

# "hit": loaded and its guards pass; "missing": no such file; "broken": a file that must not or
# cannot be used (warned); "rejected": a valid entry whose guards reject this call
Status = Literal["hit", "missing", "broken", "rejected"]


def bump(name: str) -> None:
    _compat.dynamo_counters()[COUNTERS][name] += 1


class EntryReader:
    """The entries read for one call that no entry in use accepts."""

    def __init__(
        self,
        store: CacheStore,
        self_name: str,
        function_globals: dict[str, Any],
        frame: Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, ...]],
        seed: Callable[[Path, Any], None],
        closure: tuple[Any, ...] = (),
    ) -> None:
        self.store = store
        self.no_guards = ValueGuards(self_name, (), ())
        self._globals = function_globals
        self._closure = closure  # the function's cells (a module in one is bound at load)
        self._frame = frame  # a call's (args, kwargs) -> the method's parameters' values
        self._seed = seed
        self.warned: set[str] = set()
        # why variants' value guards failed (for the one warning of a recompile)
        self.stale: list[str] = []

    def reject(self, message: str) -> None:
        """One warning (and one count) per rejected entry."""
        if message not in self.warned:
            self.warned.add(message)
            bump("rejected")
            warnings.warn(message, CacheWarning, stacklevel=4)

    def load(
        self, path: Path, key: CacheKey, call_args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Status, Any, ValueGuards]:
        """(status, compiled or None, its value guards) of the entry at ``path`` for this call."""
        none = self.no_guards
        try:
            entry = self.store.read(path)
        except CacheEntryError as exc:
            self.reject(f"npugraph_ex cache: ignoring {exc}; recompiling")
            return "broken", None, none
        if entry is None:
            return "missing", None, none
        stored = entry.metadata.get("key")
        if not isinstance(stored, dict) or CacheKey(stored).digest() != key.digest():
            self.reject(f"npugraph_ex cache: ignoring {path}: its key does not match; recompiling")
            return "broken", None, none
        try:
            guards = ValueGuards.from_json(entry.metadata.get("value_guards"))
        except FormatError as exc:
            self.reject(f"npugraph_ex cache: ignoring {path}: {exc}; recompiling")
            return "broken", None, none
        changed_value = guards.mismatch(self._globals, self._frame(call_args[1:], kwargs))
        if changed_value is not None:
            if changed_value not in self.stale:
                self.stale.append(changed_value)
            return "rejected", None, none
        try:
            compiled = _compat.load_compiled(entry.payload, self._globals, self._closure)
        except Exception as exc:  # torch raises many types here (pickle, version checks)
            self.reject(
                f"npugraph_ex cache: ignoring {path}: cannot be loaded "
                f"({type(exc).__name__}: {exc}); recompiling",
            )
            return "broken", None, none
        changed = _compat.changed_sources(compiled)
        if changed:
            self.reject(
                f"npugraph_ex cache: ignoring {path}: the code it traced has changed since "
                f"({'; '.join(changed[:3])}); recompiling",
            )
            return "broken", None, none
        if not _compat.guard_check(compiled, call_args, kwargs):
            if str(path) not in self.warned:
                self.warned.add(str(path))
                bump("guard_mismatch")
                log.info("cache: %s: its guards reject this call (a tensor's dtype, shape or "
                         "strides, or global state: grad mode, autocast, deterministic "
                         "algorithms, matmul precision, threads); another variant is used or "
                         "compiled", path)
            return "rejected", None, none
        bump("loaded")
        self._seed(path, entry.metadata.get("entry_data"))
        return "hit", compiled, guards
