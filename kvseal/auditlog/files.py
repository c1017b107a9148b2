"""Reading an audit log across its rotated files, and the time windows queries take."""

from __future__ import annotations

import gzip
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, cast

import msgspec

from kvseal.auditlog.logfiles import AuditLogError, log_files
from kvseal.auditlog.record import LoggedRequest


@dataclass
class AuditLogReader:
    """Every record of one audit log, oldest file first. A line that is not a record (a file
    edited by hand, another program's output) is skipped and counted, never silently."""

    path: Path
    num_skipped: int = 0
    first_skipped: str | None = None  # where and why, for the warning
    # the operator's actions (lines with `admin_action`: key reloads, a model disabled), as read
    admin_actions: list[dict[str, Any]] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    # about the files chosen (a duplicate read once, a gap, a name not read): for stderr
    warnings: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        chosen = log_files(self.path)
        self.files, self.warnings = chosen.files, chosen.warnings

    def records(self) -> Iterator[LoggedRequest]:
        decoder = msgspec.json.Decoder(LoggedRequest)
        for file in self.files:
            try:
                with _open(file) as lines:
                    for number, line in enumerate(lines, 1):
                        if line.strip():
                            yield from self._decoded(decoder, line, f"{file}:{number}")
            except (OSError, EOFError, zlib.error) as exc:  # unreadable, or a damaged or cut .gz
                raise AuditLogError(f"cannot read the audit log file {file}: {exc}") from exc

    def _decoded(self, decoder: msgspec.json.Decoder[LoggedRequest], line: bytes,
                 where: str) -> Iterator[LoggedRequest]:
        try:
            yield decoder.decode(line)
        except msgspec.DecodeError as exc:
            if b'"admin_action"' in line:  # an operator's action, not a request: kept apart
                try:
                    action = msgspec.json.decode(line)
                except msgspec.DecodeError:
                    action = None
                if isinstance(action, dict) and "admin_action" in action:
                    self.admin_actions.append(action)
                    return
            self._skip(f"{where}: {exc}")

    def _skip(self, where: str) -> None:
        self.num_skipped += 1
        if self.first_skipped is None:
            self.first_skipped = where


def _open(file: Path) -> IO[bytes]:
    try:
        return cast(IO[bytes], gzip.open(file, "rb")) if file.suffix == ".gz" else file.open("rb")
    except OSError as exc:
        raise AuditLogError(f"cannot read the audit log file {file}: {exc}") from exc


_FIRST_S, _LAST_S = -62_135_596_800, 253_402_300_799  # 0001-01-01 and 9999-12-31T23:59:59 UTC: datetime's range


def parse_time(text: str) -> float:
    """Unix seconds from `text`: a number (Unix seconds) or ISO 8601 (`2026-12-05T06:00:00Z`,
    `2026-12-05 06:00`, `2026-12-05`; a time without a zone is UTC)."""
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds) or not _FIRST_S <= seconds <= _LAST_S:
            raise AuditLogError(f"cannot read {text!r} as a time: give Unix seconds or ISO 8601, e.g. "
                                f"2026-12-05T06:00:00Z")
        return seconds
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise AuditLogError(f"cannot read {text!r} as a time: give Unix seconds or ISO 8601, e.g. "
                            f"2026-12-05T06:00:00Z") from None
    return (moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)).timestamp()


def iso(seconds: float | None) -> str:
    """Unix seconds as ISO 8601 in UTC, to the millisecond ('' for None)."""
    if seconds is None:
        return ""
    try:
        return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    except (OverflowError, ValueError, OSError):  # a damaged line's time, outside years 1 to 9999: shown as it is
        return repr(seconds)


@dataclass(frozen=True)
class TimeWindow:
    """[since, until) in Unix seconds; either end may be open."""

    since: float | None = None
    until: float | None = None

    def __post_init__(self) -> None:
        if self.since is not None and self.until is not None and self.until <= self.since:
            raise AuditLogError(f"--until ({iso(self.until)}) must be after --since ({iso(self.since)})")

    @classmethod
    def parse(cls, since: str | None, until: str | None) -> TimeWindow:
        return cls(None if since is None else parse_time(since), None if until is None else parse_time(until))

    @property
    def is_bounded(self) -> bool:
        return self.since is not None and self.until is not None

    def holds(self, moment: float) -> bool:
        """`moment` lies in the window."""
        return (self.since is None or moment >= self.since) and (self.until is None or moment < self.until)

    def overlaps(self, start: float, end: float) -> bool:
        """Some instant of [start, end] lies in the window: the request was in flight during it."""
        return (self.since is None or end >= self.since) and (self.until is None or start < self.until)

    def describe(self) -> str:
        return f"[{iso(self.since) or 'the start'}, {iso(self.until) or 'the end'})"
