"""readable_cache: what a cache entry holds, as text."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

from npugraph_cache.store import CacheStore

_RULE = "=" * 100


def _section(title: str, body: str) -> list[str]:
    return [_RULE, title, _RULE, body.rstrip(), ""]


def render(metadata: dict[str, Any], path: Path) -> str:
    key = metadata.get("key", {})
    env = key.get("environment", {})
    lines = [_RULE, f"npugraph_ex cache entry: {path}", _RULE]
    for name in ("func", "module_class", "created", "dynamic", "rank", "key_digest"):
        lines.append(f"{name}: {metadata.get(name)}")
    lines.append("")
    lines += _section("environment", "\n".join(f"{k}: {v}" for k, v in sorted(env.items())))
    fields = {k: v for k, v in key.items() if k not in ("environment", "input_spec")}
    lines += _section(
        "key fields",
        "\n".join(f"{k}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(fields.items())),
    )
    options = metadata.get("options") or {}
    lines += _section(
        "options",
        "\n".join(f"{k}={json.dumps(v, sort_keys=True)}" for k, v in sorted(options.items()))
        or "(defaults)",
    )
    lines += _section(
        "input spec", json.dumps(metadata.get("input_spec"), indent=2, sort_keys=True)
    )
    lines += _section("graph code (dynamo graph)", str(metadata.get("graph_code") or "(none)"))
    if metadata.get("compiler_code"):
        lines += _section(
            "compiled graph code (after the compiler's passes)", str(metadata["compiler_code"])
        )
    return "\n".join(lines) + "\n"


def readable_cache(
    cache_bin: str | os.PathLike[str],
    print_output: bool = True,
    file: str | os.PathLike[str] | None = None,
) -> str:
    """The cached graph's Python code and its metadata (key fields, options, input spec) of one
    entry file. ``cache_bin`` must be an entry (not a link) owned by the current user. With
    ``file``, the text is also written there (0600; an existing file must be a private regular
    file of the current user)."""
    path = Path(cache_bin)
    if not path.exists() and not path.is_symlink():
        raise ValueError(f"readable_cache: {path} does not exist")
    if path.is_dir():
        raise ValueError(
            f"readable_cache: {path} is a folder; give an entry file (see `npugraph-ex cache ls`)"
        )
    entry = CacheStore.read(path)
    if entry is None:
        raise ValueError(f"readable_cache: {path} does not exist")
    text = render(entry.metadata, path)
    if print_output:
        sys.stdout.write(text)
    if file is not None:
        out = Path(file)
        if out.is_symlink():
            raise ValueError(f"readable_cache: output file {out} is a symbolic link")
        if out.exists():
            st = out.stat()
            if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
                raise ValueError(
                    f"readable_cache: output file {out} exists and is not a private (0600) regular file"
                )
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    return text
