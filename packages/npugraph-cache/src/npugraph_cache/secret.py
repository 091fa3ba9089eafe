"""The per-user secret that authenticates cache entries.

Every entry carries an HMAC-SHA256 tag computed with this key over the whole entry; nothing of
an entry is unpickled unless its tag verifies. The key lives outside any cache folder, so
copying, sharing or planting a cache folder does not hand over the key:

* ``$NPUGRAPH_EX_CACHE_KEY`` (a file path) when set, else
  ``$XDG_CONFIG_HOME/npugraph_ex/cache.key`` (``~/.config/npugraph_ex/cache.key``);
* 32 random bytes, created on first use (folder 0700, file 0600, written to a temporary file and
  linked into place, so concurrent first uses agree on one key);
* refused (CachePermissionError) when it is a link, not a regular file, another user's, readable
  or writable by others, or not 32 bytes.

Deleting the key file invalidates every entry written with it (they are recompiled, with one
warning each).
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import stat
import tempfile
from hashlib import sha256
from pathlib import Path

from npugraph_cache.errors import CachePermissionError

KEY_ENV = "NPUGRAPH_EX_CACHE_KEY"
KEY_BYTES = 32
TAG_BYTES = sha256().digest_size

_loaded: dict[Path, bytes] = {}


def key_path() -> Path:
    override = os.environ.get(KEY_ENV)
    if override:
        return Path(override).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "npugraph_ex" / "cache.key"


def _read(path: Path) -> bytes:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        why = "a symbolic link, refused" if os.path.islink(path) else exc.strerror
        raise CachePermissionError(
            f"cache key file {path} cannot be opened ({why}); remove it or set {KEY_ENV} to "
            "the path of a private file"
        ) from None
    try:
        st = os.fstat(fd)
        getuid = getattr(os, "getuid", None)
        problem = ""
        if not stat.S_ISREG(st.st_mode):
            problem = "is not a regular file"
        elif getuid is not None and st.st_uid != getuid():
            problem = f"belongs to uid {st.st_uid}, not to you (uid {getuid()})"
        elif st.st_mode & 0o077:
            problem = f"has mode {stat.S_IMODE(st.st_mode):o}; it must be 600"
        if problem:
            raise CachePermissionError(
                f"cache key file {path} {problem}; remove it (a new key is created, existing "
                f"entries are recompiled) or point {KEY_ENV} at a private file"
            )
        data = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        raise CachePermissionError(
            f"cache key file {path} holds {len(data)} bytes, expected {KEY_BYTES}; remove it "
            "(a new key is created, existing entries are recompiled)"
        )
    return data


def _create(path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp_key_", dir=path.parent)  # created 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        # atomic and never replaces: when a concurrent first use wins, we read its key
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        os.unlink(tmp)


def user_key(create: bool = True) -> bytes | None:
    """This user's cache key (created when missing and ``create``); None when missing and not
    ``create``. CachePermissionError when the file is not private."""
    path = key_path()
    key = _loaded.get(path)
    if key is not None:
        return key
    try:
        key = _read(path)
    except FileNotFoundError:
        if not create:
            return None
        try:
            _create(path)
        except OSError as exc:
            raise CachePermissionError(
                f"cannot create the cache key file {path} ({exc.strerror or exc}); set {KEY_ENV} "
                "to the path of a private file in a folder you can write"
            ) from None
        key = _read(path)
    _loaded[path] = key
    return key


def tag(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, sha256).digest()


def verify(key: bytes, data: bytes, expected: bytes) -> bool:
    return hmac.compare_digest(tag(key, data), expected)
