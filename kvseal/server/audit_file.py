"""The audit log's file: whole lines appended to a path that may be deleted, rotated or full.

Contract of `AuditFile.append`:
- The line goes to the file the path names *now*. The path is looked up before every line: a
  file deleted, or renamed away by log rotation, is replaced by a new one at the path, so no
  record is written into a file nobody can find.
- The line is written by one `write(2)` with `O_APPEND`. If that fails or is short (a full
  disk), the file is cut back to its size before the write: it never holds part of a line.
- Any failure raises `OSError` and closes the file; the next `append` opens the path again.
  Nothing here retries or waits: `kvseal.server.audit.AuditLog` decides when to try again.

One writer per file is assumed (the cut-back would race with another process appending).
A line counts as written once the kernel accepted it; there is no fsync per line.
"""

from __future__ import annotations

import errno
import os

_OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
_MODE = 0o666  # less the umask, as open(path, "a") does


class AuditFile:
    def __init__(self, path: str) -> None:
        """Open (or create) `path` now: a path that cannot be opened raises `OSError` at start-up."""
        self.path = path
        self._fd: int | None = None
        self._identity: tuple[int, int] | None = None  # (device, inode) of the open file
        self._open()

    def append(self, line: bytes) -> None:
        """Write `line` (ending in a newline) whole, or raise `OSError` having written none of it."""
        try:
            fd = self._current()
            size_before = os.fstat(fd).st_size
            written = os.write(fd, line)
            if written != len(line):
                self._cut_back(fd, size_before)
                raise OSError(errno.ENOSPC, f"only {written} of {len(line)} bytes could be written")
        except OSError:
            self.close()
            raise

    def probe(self) -> None:
        """Open the path if it is not open (raises `OSError` when it cannot be)."""
        try:
            self._current()
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd, self._identity = self._fd, None, None
            os.close(fd)

    def _current(self) -> int:
        """The open file, if the path still names it; else the file at the path, opened now."""
        if self._fd is not None and self._is_at_path():
            return self._fd
        self.close()
        return self._open()

    def _is_at_path(self) -> bool:
        try:
            status = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (status.st_dev, status.st_ino) == self._identity

    def _open(self) -> int:
        fd = os.open(self.path, _OPEN_FLAGS, _MODE)
        status = os.fstat(fd)
        self._fd, self._identity = fd, (status.st_dev, status.st_ino)
        return fd

    @staticmethod
    def _cut_back(fd: int, size: int) -> None:
        """Remove a partial line. A device (such as /dev/full) cannot be truncated, and holds nothing."""
        try:
            os.ftruncate(fd, size)
        except OSError:
            pass
