"""Which files `kvseal usage` and `kvseal audit` read: every line of the log exactly once, or a
refusal or a warning that says why not. A rotated file beside its own `.gz`, logrotate's dated
files, a number missing, two names for one file, a name that is not a regular file."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from kvseal.auditlog.files import AuditLogError, AuditLogReader
from kvseal.cli import main
from kvseal.server.audit import AuditRecord


def request(request_id: str, at: float, tenant: str = "alice", completion: int = 30) -> bytes:
    return msgspec.json.encode(AuditRecord(request_id=request_id, endpoint="/v1/completions", tenant=tenant,
                                           outcome="finished", received_at=at, finished_at=at + 1, prompt_tokens=10,
                                           output_tokens=completion)) + b"\n"


def lines(first: int, count: int) -> bytes:
    return b"".join(request(f"r{i}", i, "alice" if i % 3 else "bob", completion=i) for i in range(first,
                                                                                                    first + count))


@pytest.fixture
def log(tmp_path: Path) -> Path:
    """kvseal's own rotation: a.jsonl.1 to .3, then a.jsonl; 12 requests, r0 to r11."""
    path = tmp_path / "a.jsonl"
    for number in (1, 2, 3):
        path.with_name(f"a.jsonl.{number}").write_bytes(lines(3 * (number - 1), 3))
    path.write_bytes(lines(9, 3))
    return path


def usage(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, dict[str, object]], str]:
    """(exit status, the rows by tenant, stderr) of `kvseal usage --format json`."""
    status = main(["usage", "--audit-log", str(path), "--format", "json"])
    out, err = capsys.readouterr()
    rows = {row["tenant"]: row for row in json.loads(out)["rows"]} if status == 0 else {}
    return status, rows, err


def request_ids(path: Path) -> list[str]:
    return [r.request_id for r in AuditLogReader(path).records()]


def refused(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """stderr of a `kvseal usage` that must be refused: exit 2, one line, nothing on stdout."""
    assert main(["usage", "--audit-log", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    return err


def test_the_fixtures_totals(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, rows, err = usage(log, capsys)
    assert status == 0 and err == ""
    assert (rows["alice"]["requests"], rows["alice"]["completion_tokens"]) == (8, 48)
    assert (rows["bob"]["requests"], rows["bob"]["completion_tokens"]) == (4, 18)


def test_a_rotated_file_beside_its_complete_gzip_is_read_once(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`gzip -k a.jsonl.2`, or a compressor that wrote the .gz and has not yet deleted the original."""
    _, single, _ = usage(log, capsys)
    plain = log.with_name("a.jsonl.2")
    plain.with_name("a.jsonl.2.gz").write_bytes(gzip.compress(plain.read_bytes()))
    status, rows, err = usage(log, capsys)
    assert status == 0 and rows == single
    assert f"both {plain} and {plain}.gz exist; read {plain} only: they hold the same lines" in err
    assert request_ids(log) == [f"r{i}" for i in range(12)]


def test_kvseal_audit_lists_such_a_files_requests_once(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = log.with_name("a.jsonl.2")
    plain.with_name("a.jsonl.2.gz").write_bytes(gzip.compress(plain.read_bytes()))
    assert main(["audit", "--audit-log", str(log), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert [r["request_id"] for r in json.loads(out)["requests"]] == [f"r{i}" for i in range(12)]
    assert str(plain) in json.loads(out)["files"] and f"{plain}.gz" not in json.loads(out)["files"]
    assert "they hold the same lines" in err


def cut(packed: bytes, size: int | None = None) -> bytes:
    """`packed` as a compressor caught mid-write leaves it: its first `size` bytes (default half)."""
    return packed[:len(packed) // 2 if size is None else size]


@pytest.mark.parametrize("size", [0, 5, None], ids=["empty", "in-header", "in-body"])
def test_a_gzip_cut_short_leaves_the_plain_file_read(log: Path, size: int | None,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A compressor caught mid-write: the .gz ends early and the plain file holds every line."""
    plain = log.with_name("a.jsonl.2")
    plain.write_bytes(lines(3, 3) * 200)  # long enough that half its .gz is a cut deflate stream
    _, single, _ = usage(log, capsys)
    plain.with_name("a.jsonl.2.gz").write_bytes(cut(gzip.compress(plain.read_bytes()), size))
    status, rows, err = usage(log, capsys)
    assert status == 0 and rows == single
    assert f"both {plain} and {plain}.gz exist; read {plain} only: a.jsonl.2.gz is cut short" in err


def bad_crc(packed: bytes) -> bytes:
    return packed[:-8] + bytes(4) + packed[-4:]  # a gzip file ends with its CRC-32, then its length


@pytest.mark.parametrize("packed", [
    gzip.compress(lines(3, 2) + request("other", 5)),  # as many lines, one of them different
    gzip.compress(lines(3, 2)),  # complete, and short of the plain file's last line
    gzip.compress(lines(3, 4)),  # one line more than the plain file
    cut(gzip.compress(lines(4, 2) * 200)),  # cut short, and not the plain file's start
    bad_crc(gzip.compress(lines(3, 3))),  # the same lines, a damaged checksum
], ids=["one-line-differs", "gz-is-shorter", "gz-is-longer", "cut-and-different", "bad-crc"])
def test_a_plain_file_and_its_gzip_that_differ_are_refused(log: Path, packed: bytes,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    plain = log.with_name("a.jsonl.2")
    plain.with_name("a.jsonl.2.gz").write_bytes(packed)
    err = refused(log, capsys)
    assert f"both {plain} and {plain}.gz exist and hold different lines" in err


def test_logrotate_dated_files_are_read_in_date_order_then_the_live_file(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """logrotate's `dateext` (`-%Y%m%d`, the default on RHEL-family systems), some compressed."""
    path = tmp_path / "a.jsonl"
    (tmp_path / "a.jsonl-20261209").write_bytes(lines(6, 3))  # written first, so the name is what orders them
    (tmp_path / "a.jsonl-20261207.gz").write_bytes(gzip.compress(lines(0, 3)))
    (tmp_path / "a.jsonl-20261208").write_bytes(lines(3, 3))
    (tmp_path / "a.jsonl-20261208.gz").write_bytes(gzip.compress(lines(3, 3)))  # gzip -k: read once
    path.write_bytes(lines(9, 3))
    assert request_ids(path) == [f"r{i}" for i in range(12)]
    status, rows, err = usage(path, capsys)
    assert status == 0 and (rows["alice"]["requests"], rows["alice"]["completion_tokens"]) == (8, 48)
    assert "they hold the same lines" in err
    path.unlink()  # logrotate has just renamed it; kvseal writes the next line
    assert request_ids(path) == [f"r{i}" for i in range(9)]


def test_numbered_and_dated_files_are_interleaved_by_their_last_write(tmp_path: Path) -> None:
    """kvseal's size limit and a daily logrotate on one log: each kind keeps its own order, and
    the two are merged by modification time (the time of a rotated file's last line)."""
    path = tmp_path / "a.jsonl"
    files = [("a.jsonl.1", 0), ("a.jsonl-20261207", 1), ("a.jsonl.2", 2), ("a.jsonl.3", 3),
             ("a.jsonl-20261208", 4)]
    for name, index in files:
        (tmp_path / name).write_bytes(lines(2 * index, 2))
        os.utime(tmp_path / name, (1_800_000_000 + index, 1_800_000_000 + index))
    path.write_bytes(lines(10, 2))
    reader = AuditLogReader(path)
    assert [r.request_id for r in reader.records()] == [f"r{i}" for i in range(12)]
    assert reader.files == [tmp_path / name for name, _ in files] + [path]


def test_dated_files_with_dates_in_different_forms_are_refused(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A changed `dateformat`: `-2026-12-08` sorts before `-20261207` as text; no order is trusted."""
    (tmp_path / "a.jsonl-20261207").write_bytes(lines(0, 1))
    (tmp_path / "a.jsonl-2026-12-08").write_bytes(lines(1, 1))
    assert "have dates in different forms" in refused(tmp_path / "a.jsonl", capsys)


def test_a_number_missing_between_rotated_files_is_warned(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log.with_name("a.jsonl.2").unlink()
    log.with_name("a.jsonl.5").write_bytes(lines(12, 1))
    status, _, err = usage(log, capsys)
    assert status == 0
    assert f"missing: a.jsonl.2 (between {log}.1 and {log}.3)" in err
    assert f"missing: a.jsonl.4 (between {log}.3 and {log}.5)" in err
    log.with_name("a.jsonl.1").unlink()  # the oldest deleted (--audit-log-backups): no gap
    assert usage(log, capsys)[2].count("warning: missing") == 1


@pytest.mark.parametrize("link", [os.symlink, os.link], ids=["symlink", "hard-link"])
def test_two_names_for_one_file_are_read_once(log: Path, link: Callable[[Path, Path], None],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    log.with_name("a.jsonl.3").unlink()
    link(log.with_name("a.jsonl.2"), log.with_name("a.jsonl.3"))
    status, rows, err = usage(log, capsys)
    assert status == 0 and rows["alice"]["requests"] == 6  # r6 to r8 are gone, r3 to r5 counted once
    assert f"{log}.3 is {log}.2 under another name (a link): read once" in err


@pytest.mark.parametrize("make", ["fifo", "folder", "broken-symlink"])
@pytest.mark.parametrize("name", ["a.jsonl.2", "a.jsonl"])
def test_a_name_that_is_not_a_regular_file_is_refused(log: Path, make: str, name: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A FIFO would block the reader; a folder or a broken link at the live path was skipped."""
    target = log.with_name(name)
    target.unlink()
    if make == "fifo":
        os.mkfifo(target)
    elif make == "folder":
        target.mkdir()
    else:
        target.symlink_to(log.with_name("gone"))
    err = refused(log, capsys)
    assert str(target) in err


def test_rotated_files_kvseal_cannot_decompress_are_named(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log.with_name("a.jsonl.4.xz").write_bytes(b"\xfd7zXZ\x00")
    log.with_name("a.jsonl-20261207.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    status, _, err = usage(log, capsys)
    assert status == 0
    assert f"not read: {log}-20261207.zst, {log}.4.xz: kvseal reads a.jsonl.N, a.jsonl-DATE and their .gz" in err


def test_no_file_at_all_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(AuditLogError, match=r"nor rotated files .*a.jsonl.N or .*a.jsonl-DATE"):
        AuditLogReader(tmp_path / "a.jsonl")
