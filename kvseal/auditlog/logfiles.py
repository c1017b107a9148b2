"""Which files make up an audit log, chosen so that every line is read exactly once or the
command says why not: billing totals and an incident's answers must not silently count a line
twice or leave one out.

Read, in the folder of `FILE` (the path `kvseal serve --audit-log` was given):
- `FILE.N`: kvseal's own rotation (`kvseal.server.audit_file`), in number order;
- `FILE-STAMP`: `logrotate`'s `dateext` (`FILE-20261207`, the default on RHEL-family systems),
  in the order of their stamps, which is how logrotate itself orders them;
- each of those as `.gz` too (compressed in place by the operator or logrotate);
- then `FILE` itself.

Where both kinds of rotated file exist (kvseal's size limit and a daily logrotate), their order
between kinds cannot be read from their names: the two sequences are interleaved by
modification time, the time of a rotated file's last line (renames and gzip keep it).

What is refused (exit 2, one line) or said on stderr instead of silently read wrong:
- `X` beside `X.gz` (`gzip -k`, or a compressor caught before it deleted `X`): read once. A
  complete `X.gz` holding exactly `X`'s bytes, or one cut short (a compressor caught mid-write)
  whose start is `X`'s, leaves `X` read, with a warning; any other difference is refused.
- Dated files whose stamps differ in form (`-20261207` beside `-2026-12-08`): their order is
  unknown, refused.
- A number missing between two rotated files (`FILE.4` gone between `FILE.3` and `FILE.5`):
  warned, naming it.
- Two names for one file (a symlink or hard link among them): read once, warned.
- A name that is not a regular file once links are followed (a folder, a FIFO, a broken link):
  refused (a FIFO would block the reader).
- A rotated-looking name kvseal cannot read (`FILE.3.xz`, `FILE-20261207.zst`): warned.
"""

from __future__ import annotations

import heapq
import os
import re
import stat
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvseal.errors import KvsealError

_CHUNK = 64 * 1024  # compressed bytes read at a time when comparing FILE.N with FILE.N.gz
_GZIP = 16 + zlib.MAX_WBITS  # zlib's code for the gzip format


class AuditLogError(KvsealError):
    """The audit log cannot be read, or a query was given a bad value."""


@dataclass(frozen=True)
class LogFiles:
    """The files to read, oldest first, and what an operator should be told about the choice."""

    files: list[Path]
    warnings: list[str] = field(default_factory=list)


@dataclass
class _Pair:
    """One rotated file: plain (`X`), gzipped (`X.gz`), or both."""

    plain: Path | None = None
    packed: Path | None = None


def _rotated_name(path: Path) -> re.Pattern[str]:
    return re.compile(re.escape(path.name) + r"(?:\.(?P<number>[0-9]+)|-(?P<stamp>[0-9]+(?:[-_][0-9]+)*))"
                      r"(?P<gz>\.gz)?(?P<other>\..+)?")


def log_files(path: Path) -> LogFiles:
    """`path`'s rotated files, oldest first, then `path` itself; AuditLogError when there are none."""
    warnings: list[str] = []
    numbered, dated, unreadable = _rotated(path)
    if unreadable:
        warnings.append(f"not read: {', '.join(map(str, unreadable))}: kvseal reads {path.name}.N, "
                        f"{path.name}-DATE and their .gz only (decompress these, or recompress them with gzip)")
    _refuse_mixed_stamps(dated)
    warnings += _gaps(path, [number for number, _ in numbered])
    chosen = heapq.merge([_one_of(pair, warnings) for _, pair in numbered],
                         [_one_of(pair, warnings) for _, pair in dated], key=lambda file: _regular(file).st_mtime)
    files = [*chosen, *([path] if os.path.lexists(path) else [])]
    if not files:
        raise AuditLogError(f"no audit log at {path} (nor rotated files {path}.N or {path}-DATE): give the path "
                            f"that kvseal serve --audit-log was given")
    return LogFiles(_once_each(files, warnings), warnings)


def _rotated(path: Path) -> tuple[list[tuple[int, _Pair]], list[tuple[str, _Pair]], list[Path]]:
    """The rotated files beside `path`: numbered ones in number order, dated ones in stamp order,
    and the rotated-looking ones kvseal cannot read."""
    pattern = _rotated_name(path)
    pairs: dict[str, _Pair] = {}
    numbered: list[tuple[int, _Pair]] = []
    dated: list[tuple[str, _Pair]] = []
    unreadable: list[Path] = []
    for entry in sorted(path.parent.iterdir()) if path.parent.is_dir() else ():
        match = pattern.fullmatch(entry.name)
        if match is None:
            continue
        if match["other"]:
            unreadable.append(entry)
            continue
        base = entry.name.removesuffix(".gz")
        if base not in pairs:
            pairs[base] = _Pair()
            if match["number"] is not None:
                numbered.append((int(match["number"]), pairs[base]))
            else:
                dated.append((match["stamp"], pairs[base]))
        if match["gz"]:
            pairs[base].packed = entry
        else:
            pairs[base].plain = entry
    return sorted(numbered, key=lambda n: n[0]), sorted(dated, key=lambda d: d[0]), unreadable


def _refuse_mixed_stamps(dated: list[tuple[str, _Pair]]) -> None:
    """Stamps of one form sort by date as text (logrotate requires its `dateformat` to); stamps
    of two forms (a changed `dateformat`) have no order kvseal could trust."""
    forms = {re.sub("[0-9]", "9", stamp): pair for stamp, pair in dated}
    if len(forms) > 1:
        first, second = (_name(pair) for pair in list(forms.values())[:2])
        raise AuditLogError(f"the dated audit log files {first} and {second} have dates in different forms, so "
                            f"their order is unknown: rename them to one form (as logrotate's dateformat writes)")


def _name(pair: _Pair) -> Path:
    file = pair.plain or pair.packed
    assert file is not None  # a _Pair is made for a file found
    return file


def _gaps(path: Path, numbers: list[int]) -> list[str]:
    """A number missing between two rotated files: kvseal numbers them without gaps and deletes
    only the oldest (`--audit-log-backups`), so its lines were moved or deleted by hand."""
    return [f"missing: {path.name}.{older + 1}" + (f" to .{newer - 1}" if newer - older > 2 else "")
            + f" (between {path}.{older} and {path}.{newer}): their lines are not read"
            for older, newer in zip(numbers, numbers[1:]) if newer - older > 1]


def _one_of(pair: _Pair, warnings: list[str]) -> Path:
    """The one file to read of `X` and `X.gz`, when both exist (see the module's docstring)."""
    plain, packed = pair.plain, pair.packed
    if plain is None or packed is None:
        return _name(pair)
    for file in (plain, packed):
        _regular(file)  # before opening: a FIFO would block the comparison
    agreement = _agreement(plain, packed)
    if agreement == "different":
        raise AuditLogError(f"both {plain} and {packed} exist and hold different lines: kvseal reads only one of "
                            f"them; move away the one that is wrong")
    warnings.append(f"both {plain} and {packed} exist; read {plain} only: " + (
        "they hold the same lines (a compressor had not deleted it yet)" if agreement == "same" else
        f"{packed.name} is cut short (a compressor caught mid-write) and its lines so far are {plain.name}'s"))
    return plain


def _agreement(plain: Path, packed: Path) -> Literal["same", "cut short", "different"]:
    """'same' when `packed` decompresses to its end, to exactly `plain`'s bytes; 'cut short' when
    it ends early (empty: a compressor has just begun) and all it holds is `plain`'s start; else
    'different'. Decompressed here by zlib, so that the bytes before a cut are compared too."""
    try:
        with plain.open("rb") as original, packed.open("rb") as compressed:
            unpacker, pending = zlib.decompressobj(wbits=_GZIP), b""
            while pending or (pending := compressed.read(_CHUNK)):
                if unpacker.eof:  # another gzip member follows, as gzip itself reads them
                    unpacker = zlib.decompressobj(wbits=_GZIP)
                unpacked = unpacker.decompress(pending)
                pending = unpacker.unused_data
                if original.read(len(unpacked)) != unpacked:
                    return "different"
            if not unpacker.eof:
                return "cut short"
            return "different" if original.read(1) else "same"
    except zlib.error:  # not gzip, or damaged (its checksum included)
        return "different"
    except OSError as exc:
        raise AuditLogError(f"cannot compare the audit log files {plain} and {packed}: {exc}") from exc


def _regular(file: Path) -> os.stat_result:
    """`file`'s status once links are followed; AuditLogError unless it is a regular file."""
    try:
        status = file.stat()
    except OSError as exc:
        raise AuditLogError(f"cannot read the audit log file {file}: {exc}") from exc
    if not stat.S_ISREG(status.st_mode):
        raise AuditLogError(f"the audit log file {file} is not a regular file: move it away, or give the file it "
                            f"stands for")
    return status


def _once_each(files: Iterable[Path], warnings: list[str]) -> list[Path]:
    """`files` without a second name for one already listed (a symlink or a hard link)."""
    first_name: dict[tuple[int, int], Path] = {}
    kept = []
    for file in files:
        status = _regular(file)
        identity = (status.st_dev, status.st_ino)
        if identity in first_name:
            warnings.append(f"{file} is {first_name[identity]} under another name (a link): read once")
            continue
        first_name[identity] = file
        kept.append(file)
    return kept
