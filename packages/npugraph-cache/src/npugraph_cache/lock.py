"""An exclusive advisory file lock serialising writers across processes and ranks."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import TracebackType

from npugraph_cache.errors import CachePermissionError

try:
    import fcntl
except ImportError:  # Windows: no fcntl; atomic replace still keeps readers safe
    fcntl = None  # type: ignore[assignment]


class FileLock:
    """``with FileLock(path):`` holds an exclusive ``flock`` on ``path`` (created 0600).
    The OS releases it when the process dies, so a crashed writer never blocks the others.
    The file is opened without following a link (O_NOFOLLOW): a planted link would make us create
    or lock its target; CachePermissionError instead, as for a lock file that is not ours."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def __enter__(self) -> FileLock:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            if not os.path.islink(self.path):
                raise
            raise CachePermissionError(
                f"cache lock file {self.path} is a symbolic link ({exc.strerror}); refused: "
                "remove it (someone who can write to the cache folder planted it)"
            ) from None
        st = os.fstat(fd)
        getuid = getattr(os, "getuid", None)
        if not stat.S_ISREG(st.st_mode) or (getuid is not None and st.st_uid != getuid()):
            os.close(fd)
            raise CachePermissionError(
                f"cache lock file {self.path} is not a regular file of yours; refused: remove it"
            )
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
        self._fd = fd
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
