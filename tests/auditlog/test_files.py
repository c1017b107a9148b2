"""Reading audit logs: every rotated file (plain or gzip) oldest first, the reader's record
matching the writer's, times in either spelling, and bad input refused with its reason."""

from __future__ import annotations

import gzip
from pathlib import Path

import msgspec
import pytest

from kvseal.auditlog.files import AuditLogError, AuditLogReader, TimeWindow, iso, parse_time
from kvseal.auditlog.record import LoggedRequest
from kvseal.cli import main
from kvseal.server.audit import AdminRecord, AuditRecord


def line(request_id: str, at: float) -> bytes:
    return msgspec.json.encode(AuditRecord(request_id=request_id, endpoint="/v1/completions", tenant="a",
                                           outcome="finished", received_at=at, finished_at=at + 1,
                                           prompt=[{"role": "user", "content": "hi"}])) + b"\n"


def test_the_reader_knows_every_field_the_writer_writes() -> None:
    assert LoggedRequest.__struct_fields__ == AuditRecord.__struct_fields__


def test_rotated_and_compressed_files_are_read_oldest_first(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    (tmp_path / "audit.jsonl.1.gz").write_bytes(gzip.compress(line("r1", 1) + line("r2", 2)))
    (tmp_path / "audit.jsonl.2").write_bytes(line("r3", 3) + b"not json\n")
    (tmp_path / "audit.jsonl.10").write_bytes(line("r4", 4))
    (tmp_path / "audit.jsonl.bak").write_bytes(line("other", 9))  # not a rotated file
    path.write_bytes(line("r5", 5))
    reader = AuditLogReader(path)
    assert [r.request_id for r in reader.records()] == ["r1", "r2", "r3", "r4", "r5"]
    assert reader.num_skipped == 1 and reader.first_skipped is not None
    assert reader.first_skipped.startswith(f"{tmp_path / 'audit.jsonl.2'}:2:")


def test_a_damaged_gzip_file_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "audit.jsonl.1.gz").write_bytes(gzip.compress(line("r1", 1) * 50)[:40])
    with pytest.raises(AuditLogError, match=r"audit.jsonl.1.gz"):
        list(AuditLogReader(tmp_path / "audit.jsonl").records())


def test_a_gzip_file_with_a_damaged_body_is_an_error_naming_it(tmp_path: Path) -> None:
    """A valid header over a corrupt deflate stream: zlib's own error, which is not an OSError."""
    packed = bytearray(gzip.compress(line("r1", 1) * 50))
    packed[20:30] = b"\xff" * 10
    (tmp_path / "audit.jsonl.1.gz").write_bytes(bytes(packed))
    with pytest.raises(AuditLogError, match=r"audit.jsonl.1.gz"):
        list(AuditLogReader(tmp_path / "audit.jsonl").records())


def test_times_outside_the_calendar_are_refused_or_shown_as_numbers() -> None:
    for bad in ("1e20", "-1e20"):
        with pytest.raises(AuditLogError, match="ISO 8601"):
            parse_time(bad)
    assert iso(1e20) == "1e+20"  # a damaged line's time is printed as it is, not a traceback


def test_times_as_unix_seconds_or_iso() -> None:
    assert parse_time("1764915600") == parse_time("2025-12-05T06:20:00Z") == parse_time("2025-12-05 06:20")
    assert parse_time("2025-12-05T07:20:00+01:00") == 1764915600
    assert iso(1764915600.5) == "2025-12-05T06:20:00.500Z"
    for bad in ("yesterday", "nan", "2025-13-01"):
        with pytest.raises(AuditLogError, match="ISO 8601"):
            parse_time(bad)
    with pytest.raises(AuditLogError, match="must be after"):
        TimeWindow.parse("2025-12-05T07:00Z", "2025-12-05T06:00Z")
    window = TimeWindow(10.0, 20.0)
    assert window.holds(10.0) and not window.holds(20.0)
    assert window.overlaps(5.0, 10.0) and not window.overlaps(20.0, 25.0) and window.overlaps(19.0, 30.0)


@pytest.mark.parametrize("args, message", [
    (["usage", "--audit-log", "/nonexistent/audit.jsonl"], "no audit log at /nonexistent/audit.jsonl"),
    (["usage", "--audit-log", "{log}", "--since", "soon"], "cannot read 'soon' as a time"),
])
def test_bad_input_is_one_line_and_a_non_zero_exit(tmp_path: Path, args: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "audit.jsonl").write_bytes(line("r1", 1))
    assert main([a.replace("{log}", str(tmp_path / "audit.jsonl")) for a in args]) != 0
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and message in err, err


def test_admin_lines_are_the_operators_actions_not_unreadable_lines(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The server writes its admin records (`AdminRecord`) into the same log: the reader keeps them
    apart instead of counting them as lines it could not read, and `kvseal audit` lists those in
    its window after the requests."""
    path = tmp_path / "audit.jsonl"
    disabled = msgspec.json.encode(AdminRecord(admin_action="model_disabled", at=150.0, trigger="http",
                                               by_tenant="ops", model="m", num_aborted=2)) + b"\n"
    reloaded = msgspec.json.encode(AdminRecord(admin_action="keys_reloaded", at=500.0, trigger="sighup")) + b"\n"
    path.write_bytes(line("r1", 100) + disabled + line("r2", 200) + reloaded)
    reader = AuditLogReader(path)
    assert [r.request_id for r in reader.records()] == ["r1", "r2"]
    assert reader.num_skipped == 0
    assert [a["admin_action"] for a in reader.admin_actions] == ["model_disabled", "keys_reloaded"]
    assert main(["audit", "--audit-log", str(path), "--since", "0", "--until", "300"]) == 0
    out, err = capsys.readouterr()
    assert "model_disabled" in out and "keys_reloaded" not in out and "1 admin action(s) in the window" in out
    assert "skipped" not in err
