"""The audit log's file: whole lines appended to a path that may be deleted, rotated or full.

Contract of `AuditFile.append`:
- The line goes to the file the path names *now*. The path is looked up before every line: a
  file deleted, or renamed away by log rotation, is replaced by a new one at the path, so no
  record is written into a file nobody can find.
- The line is written by one `write(2)` with `O_APPEND`. If that fails or is short (a full
  disk), the file is cut back to its size before the write: it never holds part of a line.
- Any failure raises `OSError` and closes the file; the next `append` opens the path again.
  Nothing here retries or waits: `kvseal.server.audit.AuditLog` decides when to try again.

Rotation (`max_bytes`, `max_age_s`): a line that would take the file past `max_bytes`, or that
comes `max_age_s` or more after the file's first line, first closes it (fsync, then one atomic
rename to `PATH.N`, N one more than the highest number already there) and goes to a new file at
the path (the age of a file found at start counts from its last write). Lines are appended
whole, so every file holds whole lines, and a crash between the rename and the next open loses
nothing (the next line opens a new file). A file never grows past `max_bytes` unless one line
alone is longer. Rotated files keep their
number for good: `PATH.1` is the oldest, readers (`kvseal.auditlog.logfiles`) read them in number
order, then `PATH`. With `num_backups` set, the oldest beyond that many are deleted after a
rotation (logged at WARNING with the file's name: evidence is never deleted silently).

The file is the server user's alone: a new one (at start, after a rotation or a deletion) is
created with mode 0600, whatever the umask, since it holds every tenant's request metadata and,
with `--audit-log-prompts`, their prompts. A regular file found with access for other users
(one an older kvseal made 0644) loses it, with a warning; its group bits are the operator's.

One writer per file is assumed (the cut-back would race with another process appending).
A line counts as written once the kernel accepted it; there is no fsync per line (a rotated
file is fsynced once, before it is renamed).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import time
from collections.abc import Callable
from pathlib import Path

_OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
_MODE = 0o600  # the server user's only (the umask can only take more away)
_OTHERS = stat.S_IRWXO

logger = logging.getLogger("kvseal.audit")


def rotated_number(path: Path, name: str) -> int | None:
    """N when `name` is a rotated file of `path` (`PATH.N`, or `PATH.N.gz` compressed by the
    operator), else None."""
    match = re.fullmatch(re.escape(path.name) + r"\.([0-9]+)(\.gz)?", name)
    return int(match.group(1)) if match else None


def rotated_files(path: Path) -> list[tuple[int, Path]]:
    """The rotated files of `path`, oldest (lowest number) first."""
    found = []
    for entry in path.parent.iterdir() if path.parent.is_dir() else ():
        number = rotated_number(path, entry.name)
        if number is not None:
            found.append((number, entry))
    return sorted(found)


class AuditFile:
    def __init__(self, path: str, *, max_bytes: int | None = None, max_age_s: float | None = None,
                 num_backups: int | None = None, clock: Callable[[], float] = time.time) -> None:
        """Open (or create) `path` now: a path that cannot be opened raises `OSError` at start-up.
        `max_bytes` and `max_age_s` None never rotate; `num_backups` None keeps every rotated
        file; `clock` is the wall clock the age is measured by."""
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if max_age_s is not None and not max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        if num_backups is not None and num_backups < 0:
            raise ValueError(f"num_backups must be >= 0, got {num_backups}")
        self.path = path
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.num_backups = num_backups
        self._clock = clock
        self._first_line_at: float | None = None  # wall time of the open file's first line (None: empty)
        self._fd: int | None = None
        self._identity: tuple[int, int] | None = None  # (device, inode) of the open file
        self._open()

    def append(self, line: bytes) -> None:
        """Write `line` (ending in a newline) whole, or raise `OSError` having written none of it."""
        try:
            fd = self._current()
            size_before = os.fstat(fd).st_size
            now = self._clock()
            if self._is_full(size_before, len(line)) or self._is_old(size_before, now):
                self._rotate(fd)
                fd, size_before = self._open(), 0
            written = os.write(fd, line)
            if written != len(line):
                self._cut_back(fd, size_before)
                raise OSError(errno.ENOSPC, f"only {written} of {len(line)} bytes could be written")
            if size_before == 0:
                self._first_line_at = now
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

    def _is_full(self, size: int, num_line_bytes: int) -> bool:
        return self.max_bytes is not None and size > 0 and size + num_line_bytes > self.max_bytes

    def _is_old(self, size: int, now: float) -> bool:
        return (self.max_age_s is not None and size > 0 and self._first_line_at is not None
                and now - self._first_line_at >= self.max_age_s)

    def _rotate(self, fd: int) -> None:
        """Close the file at the path as `PATH.N` (whole lines, fsynced) and delete backups beyond
        `num_backups`. Raises `OSError` (the line then waits, as for any failed write)."""
        os.fsync(fd)
        path = Path(self.path)
        existing = rotated_files(path)
        target = path.with_name(f"{path.name}.{existing[-1][0] + 1 if existing else 1}")
        os.rename(path, target)  # atomic: a reader sees the file under one name or the other
        self.close()
        logger.info("rotated the audit log %s to %s", path, target)
        if self.num_backups is not None:
            self._delete_oldest([old for _, old in existing] + [target], self.num_backups)

    @staticmethod
    def _delete_oldest(rotated: list[Path], num_kept: int) -> None:
        """Delete all but the newest `num_kept` of `rotated` (oldest first). A file that cannot be
        deleted is logged and left: it costs disk, not audit lines."""
        for old in rotated[:max(0, len(rotated) - num_kept)]:
            logger.warning("deleting the audit log backup %s: --audit-log-backups keeps the newest %d", old,
                           num_kept)
            try:
                old.unlink(missing_ok=True)
            except OSError as exc:
                logger.error("cannot delete the audit log backup %s: %s", old, exc)

    def _is_at_path(self) -> bool:
        try:
            status = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (status.st_dev, status.st_ino) == self._identity

    def _open(self) -> int:
        fd = os.open(self.path, _OPEN_FLAGS, _MODE)
        status = os.fstat(fd)
        if stat.S_ISREG(status.st_mode) and status.st_mode & _OTHERS:
            self._close_to_others(fd, status.st_mode)
        self._fd, self._identity = fd, (status.st_dev, status.st_ino)
        self._first_line_at = status.st_mtime if status.st_size else None
        return fd

    def _close_to_others(self, fd: int, mode: int) -> None:
        """Take other users' access away from a file found with it (a failure closes the fd and raises)."""
        try:
            os.fchmod(fd, stat.S_IMODE(mode) & ~_OTHERS)
        except OSError:
            os.close(fd)
            raise
        logger.warning("the audit log %s was open to other users (mode %o); it is now %o: it holds every "
                       "tenant's request records", self.path, stat.S_IMODE(mode), stat.S_IMODE(mode) & ~_OTHERS)

    @staticmethod
    def _cut_back(fd: int, size: int) -> None:
        """Remove a partial line. A device (such as /dev/full) cannot be truncated, and holds nothing."""
        try:
            os.ftruncate(fd, size)
        except OSError:
            pass
