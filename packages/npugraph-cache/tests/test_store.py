"""Owner-only folders and files, atomic writes, refusal of entries that are not ours."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from npugraph_cache import secret
from npugraph_cache.errors import CacheEntryError, CachePermissionError
from npugraph_cache.format import encode
from npugraph_cache.secret import KEY_ENV
from npugraph_cache.store import CacheStore, clear, iter_entries


def user_key() -> bytes:
    return CacheStore().key


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_layout_folders_are_0700_and_entries_0600(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "cache")
    func_dir = store.func_dir("Model_dynamic_abc", "world2global_rank1", "decode")
    assert func_dir == tmp_path / "cache" / "Model_dynamic_abc" / "world2global_rank1" / "decode"
    store.ensure_dir(func_dir)
    path = store.entry_path(func_dir, "f" * 64)
    store.write(path, encode({"a": 1}, b"x", user_key()))
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
    CacheStore.write(path, encode({"a": 1}, b"x", user_key()))
    os.chmod(path, 0o644)
    with pytest.raises(CacheEntryError, match="mode 644"):
        CacheStore.read(path)


def test_symlinked_entry_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real.ngx"
    CacheStore.write(real, encode({"a": 1}, b"x", user_key()))
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
    store.write(store.entry_path(func_dir, "a" * 64), encode({}, b"", user_key()))
    store.write(store.entry_path(func_dir, "b" * 64), encode({}, b"", user_key()))
    assert len(list(iter_entries(tmp_path / "cache"))) == 2
    assert clear(tmp_path / "cache") == 2
    assert list((tmp_path / "cache").iterdir()) == []


def test_group_or_world_writable_cache_folder_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    os.chmod(root, 0o777)
    store = CacheStore(root)
    with pytest.raises(CachePermissionError, match=r"mode 777.*chmod 700"):
        store.ensure_dir(store.func_dir("M_static_1", "", "decode"))
    assert list(root.iterdir()) == []


def test_planted_lock_symlink_is_refused_and_its_target_never_created(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "cache")
    func_dir = store.func_dir("M_static_1", "", "decode")
    store.ensure_dir(func_dir)
    target = tmp_path / "victim"
    (func_dir / ".lock").symlink_to(target)
    with pytest.raises(CachePermissionError, match="symbolic link"), store.lock(func_dir):
        pass
    assert not target.exists()


def test_key_file_is_created_once_private_and_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "conf" / "key"
    monkeypatch.setenv(KEY_ENV, str(path))
    key = secret.user_key()
    assert key is not None and len(key) == 32
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    assert path.read_bytes() == key
    secret._loaded.clear()
    assert secret.user_key() == key  # read back, not replaced


@pytest.mark.parametrize("problem", ["mode", "link", "size"])
def test_key_file_others_could_read_or_replace_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, problem: str
) -> None:
    path = tmp_path / "key"
    if problem == "link":
        (tmp_path / "real").write_bytes(b"k" * 32)
        path.symlink_to(tmp_path / "real")
    else:
        path.write_bytes(b"k" * (32 if problem == "mode" else 5))
        os.chmod(path, 0o644 if problem == "mode" else 0o600)
    monkeypatch.setenv(KEY_ENV, str(path))
    with pytest.raises(CachePermissionError, match=str(path)):
        secret.user_key()


def test_unusable_key_path_is_a_clear_error_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(KEY_ENV, str(blocker / "key"))  # a folder that is a file
    with pytest.raises(CachePermissionError, match=f"cannot be opened \\(Not a directory\\).* set {KEY_ENV}"):
        secret.user_key()
