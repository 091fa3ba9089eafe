"""Owner-only folders and files, atomic writes, refusal of entries that are not ours."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from npugraph_cache.format import encode
from npugraph_cache.store import CacheEntryError, CacheStore, clear, iter_entries


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_layout_folders_are_0700_and_entries_0600(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "cache")
    func_dir = store.func_dir("Model_dynamic_abc", "world2global_rank1", "decode")
    assert func_dir == tmp_path / "cache" / "Model_dynamic_abc" / "world2global_rank1" / "decode"
    store.ensure_dir(func_dir)
    path = store.entry_path(func_dir, "f" * 64)
    store.write(path, encode({"a": 1}, b"x"))
    for p in (tmp_path / "cache", func_dir.parent.parent, func_dir.parent, func_dir):
        assert _mode(p) == 0o700
    assert _mode(path) == 0o600
    assert [p.name for p in func_dir.iterdir()] == [path.name]  # no temporary file left
    entry = store.read(path)
    assert entry is not None and entry.metadata == {"a": 1}


def test_missing_entry_reads_as_none(tmp_path: Path) -> None:
    assert CacheStore.read(tmp_path / "nothing.ngx") is None


def test_entry_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "compiled_x.ngx"
    CacheStore.write(path, encode({"a": 1}, b"x"))
    os.chmod(path, 0o644)
    with pytest.raises(CacheEntryError, match="mode 644"):
        CacheStore.read(path)


def test_symlinked_entry_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real.ngx"
    CacheStore.write(real, encode({"a": 1}, b"x"))
    link = tmp_path / "compiled_link.ngx"
    link.symlink_to(real)
    with pytest.raises(CacheEntryError, match="not a regular file"):
        CacheStore.read(link)


def test_garbage_entry_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "compiled_g.ngx"
    CacheStore.write(path, b"garbage" * 20)
    with pytest.raises(CacheEntryError, match=str(path)):
        CacheStore.read(path)


def test_clear_removes_entries_and_empty_folders(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "cache")
    func_dir = store.func_dir("M_static_1", "", "prompt")
    store.ensure_dir(func_dir)
    store.write(store.entry_path(func_dir, "a" * 64), encode({}, b""))
    store.write(store.entry_path(func_dir, "b" * 64), encode({}, b""))
    assert len(list(iter_entries(tmp_path / "cache"))) == 2
    assert clear(tmp_path / "cache") == 2
    assert list((tmp_path / "cache").iterdir()) == []
