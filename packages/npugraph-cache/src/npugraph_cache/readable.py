"""readable_cache: what a cache entry holds, as text.

Only the entry's JSON metadata is read (never its payload, so nothing is unpickled), whether or
not it was written with this user's key (the text says which). Every value comes from a file
someone may have written: control characters (ANSI/OSC escape sequences included) are shown
escaped, never sent to the terminal, and metadata of the wrong shape is a one-line error.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

from npugraph_cache.errors import (
    CacheArgumentError,
    CacheEntryError,
    CacheTypeError,
    FormatError,
    describe,
)
from npugraph_cache.guards import shown_value
from npugraph_cache.store import CacheStore

_RULE = "=" * 100
# C0 and C1 controls and DEL, except newline and tab (graph code is multi-line and indented).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def escape_controls(text: str) -> str:
    r"""``\x1b[31m`` -> ``\\x1b[31m``: nothing in the text can drive the terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _section(title: str, body: str) -> list[str]:
    return [_RULE, title, _RULE, body.rstrip(), ""]


def _mapping(metadata: dict[str, Any], name: str) -> dict[str, Any]:
    value = metadata.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise FormatError(f"metadata field {name!r} is {type(value).__name__}, expected an object")
    return value


def render(metadata: dict[str, Any], path: Path, authenticated: bool = True) -> str:
    """FormatError (a ValueError, one line) when the metadata does not have the shape we write."""
    key = _mapping(metadata, "key")
    env = _mapping(key, "environment")
    options = _mapping(metadata, "options")
    lines = [_RULE, f"npugraph_ex cache entry: {path}", _RULE]
    for name in ("func", "module_class", "created", "dynamic", "rank", "key_digest"):
        lines.append(f"{name}: {metadata.get(name)}")
    lines.append(
        "authenticated: "
        + ("yes (written with your cache key)" if authenticated else
           "NO: not written with your cache key; cache_compile will not load it")
    )
    lines.append("")
    lines += _section("environment", "\n".join(f"{k}: {v}" for k, v in sorted(env.items())))
    fields = {k: v for k, v in key.items() if k not in ("environment", "input_spec")}
    lines += _section(
        "key fields",
        "\n".join(f"{k}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(fields.items())),
    )
    lines += _section(
        "options",
        "\n".join(f"{k}={json.dumps(v, sort_keys=True)}" for k, v in sorted(options.items()))
        or "(defaults)",
    )
    lines += _section(
        "input spec", json.dumps(metadata.get("input_spec"), indent=2, sort_keys=True)
    )
    guards = _mapping(metadata, "value_guards")
    sources = guards.get("sources") or []
    if sources:
        expected = guards.get("expected")
        shown = expected if isinstance(expected, list) and len(expected) == len(sources) else []
        lines += _section(
            "values the traced code read, as compiled (another value selects or compiles "
            "another entry; globals and closure cells are checked on every call, the rest when "
            "an entry is picked)",
            "\n".join(f"{source} = {shown_value(value)}" if shown else str(source)
                      for source, value in zip(sources, shown or sources, strict=True)),
        )
    lines += _section("graph code (dynamo graph)", str(metadata.get("graph_code") or "(none)"))
    if metadata.get("compiler_code"):
        lines += _section(
            "compiled graph code (after the compiler's passes)", str(metadata["compiler_code"])
        )
    return escape_controls("\n".join(lines)) + "\n"


def readable_cache(
    cache_bin: str | os.PathLike[str],
    print_output: bool = True,
    file: str | os.PathLike[str] | None = None,
) -> str:
    """The cached graph's Python code and its metadata (key fields, options, input spec) of one
    entry file. ``cache_bin`` must be an entry (not a link) owned by the current user. With
    ``file``, the text is also written there (0600; an existing file must be a private regular
    file of the current user). Never unpickles anything."""
    if not isinstance(cache_bin, str | os.PathLike) or isinstance(cache_bin, bytes):
        raise CacheTypeError(
            f"readable_cache: cache_bin must be the path (str or os.PathLike) of an entry file, "
            f"got {describe(cache_bin)}"
        )
    if file is not None and (not isinstance(file, str | os.PathLike) or isinstance(file, bytes)):
        raise CacheTypeError(
            f"readable_cache: file must be a path (str or os.PathLike) or None, got "
            f"{describe(file)}"
        )
    if not isinstance(print_output, bool):
        raise CacheTypeError(
            f"readable_cache: print_output must be True or False, got {describe(print_output)}"
        )
    path = Path(cache_bin)
    if not path.exists() and not path.is_symlink():
        raise CacheArgumentError(f"readable_cache: cache_bin {str(path)!r} does not exist")
    if path.is_dir():
        raise CacheArgumentError(
            f"readable_cache: cache_bin {str(path)!r} is a folder; give an entry file (see "
            "`npugraph-ex cache ls`)"
        )
    metadata, authenticated = CacheStore.read_metadata(path)
    try:
        text = render(metadata, path, authenticated)
    except (ValueError, TypeError, AttributeError) as exc:
        raise CacheEntryError(path, f"malformed metadata ({type(exc).__name__}: {exc})") from None
    if print_output:
        sys.stdout.write(text)
    if file is not None:
        out = Path(file)
        if out.is_symlink():
            raise CacheArgumentError(f"readable_cache: output file {out} is a symbolic link")
        if out.exists():
            st = out.stat()
            if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
                raise CacheArgumentError(
                    f"readable_cache: output file {out} exists and is not a private (0600) "
                    "regular file"
                )
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    return text
