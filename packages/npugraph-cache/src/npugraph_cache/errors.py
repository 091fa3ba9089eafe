"""The cache's error types. Each subclasses the builtin it replaces (ValueError, TypeError), so
code that caught those keeps working; ``CacheError`` catches them all."""

from __future__ import annotations

from pathlib import Path


class CacheError(Exception):
    """Base of every error npugraph_cache raises."""


class CacheArgumentError(CacheError, ValueError):
    """An argument of cache_compile / readable_cache / the CLI has a value that is not allowed;
    the message names the argument, the value and what is allowed."""


class CacheTypeError(CacheError, TypeError):
    """An argument has the wrong type; the message names the argument, the value and the types
    allowed."""


class CachePermissionError(CacheError, ValueError):
    """A cache folder, lock file or key file that others could write to, that belongs to another
    user, or that is a symbolic link: the cache refuses to trust it."""


class FormatError(CacheError, ValueError):
    """A file that is not a valid entry of this format version (the message says why)."""


class CacheEntryError(CacheError, ValueError):
    """An entry that must not be loaded; the message names the file and the reason."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def describe(value: object) -> str:
    """``int 5`` / ``str 'x'``: a value as an error message shows it (type, then a short repr)."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


class CacheWarning(UserWarning):
    """An entry was ignored (and recompiled) or could not be saved."""
