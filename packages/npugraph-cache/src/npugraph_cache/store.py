"""Where entries live and how they are written and read.

Layout: ``<cache_dir>/<model_info>/[<rank>/]<func>/compiled_<key>.ngx`` plus a ``.lock`` file per
func folder. Folders we create are 0700 and files 0600; an entry is written to a temporary file
in the same folder and renamed over the final name, so a reader sees either nothing or a whole
entry. Only regular files owned by the current user and not readable by others are loaded, and
only when their tag verifies with the user's key (``format``). A cache folder that others can
write to, or that belongs to another user, is refused (as ssh refuses such a key folder); links
are never followed (entries, folders and the lock file).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from npugraph_cache.errors import CacheEntryError, CachePermissionError, FormatError
from npugraph_cache.format import Entry, decode, read_metadata
from npugraph_cache.lock import FileLock
from npugraph_cache.secret import user_key

__all__ = ["DEFAULT_CACHE_DIR", "CacheEntryError", "CacheStore", "check_owned", "clear", "iter_entries"]

DEFAULT_CACHE_DIR = ".npugraph_ex_cache"
ENTRY_PREFIX = "compiled_"
ENTRY_SUFFIX = ".ngx"
LOCK_NAME = ".lock"


def _uid() -> int | None:
    getuid = getattr(os, "getuid", None)
    return getuid() if getuid is not None else None


def check_owned(path: Path, what: str) -> None:
    """CachePermissionError unless ``path`` (not followed if a link) is a folder of the current
    user that nobody else can write to."""
    uid = _uid()
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        raise CachePermissionError(f"{what} {path} is a symbolic link; give the real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise CachePermissionError(f"{what} {path} is not a directory")
    if uid is not None and st.st_uid != uid:
        raise CachePermissionError(
            f"{what} {path} belongs to uid {st.st_uid}, not to the current user (uid {uid}); "
            "use a cache_dir of your own"
        )
    if st.st_mode & 0o022:
        raise CachePermissionError(
            f"{what} {path} has mode {stat.S_IMODE(st.st_mode):o}: others can write to it and "
            f"plant entries or links; refused (run `chmod 700 {path}`, or use another cache_dir)"
        )


class CacheStore:
    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root if root is not None else DEFAULT_CACHE_DIR)

    @property
    def key(self) -> bytes:
        """The user's key that authenticates entries (``npugraph_cache.secret``)."""
        return _key()

    def func_dir(self, model_info: str, rank: str, func_name: str) -> Path:
        parts = [model_info] + ([rank] if rank else []) + [func_name]
        return self.root.joinpath(*parts)

    def ensure_dir(self, path: Path) -> None:
        """Create ``path`` and its missing parents 0700; the root must be ours."""
        if self.root.exists():
            check_owned(self.root, "cache_dir")
        else:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        current = self.root
        for part in path.relative_to(self.root).parts:
            current = current / part
            try:
                current.mkdir(mode=0o700)
            except FileExistsError:
                check_owned(current, "cache folder")
            else:
                os.chmod(current, 0o700)  # mkdir's mode is masked by the umask

    @staticmethod
    def entry_path(func_dir: Path, key_digest: str, variant: int = 0) -> Path:
        """Variants of one key hold graphs whose guards differ where the key does not."""
        suffix = f"_{variant}" if variant else ""
        return func_dir / f"{ENTRY_PREFIX}{key_digest[:24]}{suffix}{ENTRY_SUFFIX}"

    @staticmethod
    def lock(func_dir: Path) -> FileLock:
        return FileLock(func_dir / LOCK_NAME)

    @staticmethod
    def write(path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".tmp_", dir=path.parent)  # mkstemp creates 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @staticmethod
    def read(path: Path, key: bytes | None = None) -> Entry | None:
        """None when there is no entry; CacheEntryError when there is one we must not load
        (``key``: the user's key by default)."""
        data = read_private(path)
        if data is None:
            return None
        try:
            return decode(data, key if key is not None else _key())
        except FormatError as exc:
            raise CacheEntryError(path, str(exc)) from None

    @staticmethod
    def read_metadata(path: Path) -> tuple[dict[str, Any], bool]:
        """(metadata, authenticated) of an entry, never touching its payload (for showing it)."""
        data = read_private(path)
        if data is None:
            raise CacheEntryError(path, "does not exist")
        try:
            return read_metadata(data, user_key(create=False))
        except FormatError as exc:
            raise CacheEntryError(path, str(exc)) from None


def _key() -> bytes:
    key = user_key()
    assert key is not None
    return key


def read_private(path: Path) -> bytes | None:
    """The bytes of a regular file of ours that others cannot read (opened without following a
    link); None when it does not exist; CacheEntryError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        reason = "not a regular file (a symbolic link)" if path.is_symlink() else f"unreadable: {exc.strerror}"
        raise CacheEntryError(path, reason) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a folder
        os.close(fd)
        raise CacheEntryError(path, "not a regular file (a link or a folder)")
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        uid = _uid()
        if uid is not None and st.st_uid != uid:
            raise CacheEntryError(path, f"owned by uid {st.st_uid}, not the current user")
        if st.st_mode & 0o077:
            raise CacheEntryError(path, f"mode {stat.S_IMODE(st.st_mode):o}, expected 600")
        try:
            return f.read()
        except OSError as exc:
            raise CacheEntryError(path, f"unreadable: {exc}") from None


def iter_entries(root: Path) -> Iterator[Path]:
    """Every entry file below ``root``, sorted."""
    if root.is_file():
        yield root
        return
    yield from sorted(p for p in root.rglob(f"{ENTRY_PREFIX}*{ENTRY_SUFFIX}") if p.is_file())


def clear(root: Path) -> int:
    """Delete every entry below ``root`` and the folders left empty; returns the entries removed.
    Refuses a root that is not ours."""
    if not root.exists():
        return 0
    check_owned(root, "cache_dir")
    removed = 0
    for path in list(iter_entries(root)):
        path.unlink()
        removed += 1
    for folder in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        leftovers = [
            p for p in folder.iterdir() if p.name != LOCK_NAME and not p.name.startswith(".tmp_")
        ]
        if not leftovers:
            shutil.rmtree(folder)
    return removed
