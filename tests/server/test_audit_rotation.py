"""Audit log rotation (`--audit-log-max-bytes`, `--audit-log-backups`): lines are never lost or
split across a rotation, files stay within their size, numbers count up, and only the backups
beyond the kept number are deleted."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from kvseal.errors import ConfigError
from kvseal.server.audit import AuditLog, AuditRecord
from kvseal.server.audit_file import rotated_files
from kvseal.server.config import ServerConfig

MAX_BYTES = 2048


def record(index: int) -> AuditRecord:
    return AuditRecord(request_id=f"cmpl-{index:05d}", endpoint="/v1/completions", tenant=f"t{index % 3}",
                       outcome="finished", received_at=1000.0 + index, finished_at=1000.5 + index,
                       prompt_tokens=index % 17, output_tokens=index % 5, user="u" * (index % 40))


def ids_in(path: Path) -> list[str]:
    text = path.read_bytes().decode()
    assert text == "" or text.endswith("\n"), f"{path} ends inside a line"
    return [json.loads(line)["request_id"] for line in text.splitlines()]


def all_files(path: Path) -> list[Path]:
    return [p for _, p in rotated_files(path)] + [path]


def test_rotation_keeps_every_line_whole_and_in_order(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), include_prompts=False, max_bytes=MAX_BYTES)
    for index in range(500):
        assert log.write(record(index))
    log.close()
    files = all_files(path)
    assert len(files) > 10
    assert [int(p.name.rsplit(".", 1)[1]) for p in files[:-1]] == list(range(1, len(files)))
    for file in files:
        assert 0 < file.stat().st_size <= MAX_BYTES
    assert [i for file in files for i in ids_in(file)] == [f"cmpl-{i:05d}" for i in range(500)]


def test_a_restarted_writer_continues_the_numbering(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    for start in (0, 100):
        log = AuditLog(str(path), include_prompts=False, max_bytes=MAX_BYTES)
        for index in range(start, start + 100):
            log.write(record(index))
        log.close()
    assert [i for file in all_files(path) for i in ids_in(file)] == [f"cmpl-{i:05d}" for i in range(200)]


def test_backups_beyond_the_kept_number_are_deleted_oldest_first(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), include_prompts=False, max_bytes=MAX_BYTES, num_backups=3)
    for index in range(300):
        log.write(record(index))
    log.close()
    numbers = [n for n, _ in rotated_files(path)]
    assert len(numbers) == 3 and numbers == list(range(numbers[0], numbers[0] + 3)) and numbers[0] > 1
    kept = [i for file in all_files(path) for i in ids_in(file)]
    assert kept == [f"cmpl-{i:05d}" for i in range(300 - len(kept), 300)]  # the newest, none missing


def test_a_line_longer_than_the_limit_gets_a_file_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), include_prompts=True, max_bytes=1024)
    log.write(record(0))
    log.write(AuditRecord(request_id="big", endpoint="/v1/completions", tenant="t", outcome="finished",
                          received_at=1.0, finished_at=2.0, prompt="x" * 3000))
    log.write(record(1))
    log.close()
    assert [ids_in(p) for p in all_files(path)] == [["cmpl-00000"], ["big"], ["cmpl-00001"]]


def test_a_rotation_that_fails_keeps_the_lines_waiting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rename fails as on a read-only folder (tests run as root, where chmod would not stop
    it): the lines wait, the log says why, and once renames work the lines go in, in order."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), include_prompts=False, retry_s=0.0, max_bytes=1024)

    def read_only(src: object, dst: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    index = 0
    with monkeypatch.context() as patch:
        patch.setattr(os, "rename", read_only)
        while log.failure is None:
            log.write(record(index))
            index += 1
            assert index < 100
        for _ in range(5):
            assert not log.write(record(index))
            index += 1
        failing = log.failure
    assert failing is not None and "Read-only" in failing
    assert log.check() is None  # recovered: the waiting lines went in, in order
    log.close()
    assert [i for file in all_files(path) for i in ids_in(file)] == [f"cmpl-{i:05d}" for i in range(index)]


@pytest.mark.parametrize("kwargs, message", [
    ({"audit_log_max_bytes": 4096}, "give --audit-log FILE"),
    ({"audit_log_path": "a.jsonl", "audit_log_max_bytes": 100}, ">= 1024"),
    ({"audit_log_path": "a.jsonl", "audit_log_backups": 3}, "give --audit-log-max-bytes or --audit-log-max-age-s"),
    ({"audit_log_max_age_s": 60.0}, "give --audit-log FILE"),
    ({"audit_log_path": "a.jsonl", "audit_log_max_age_s": 0.0}, "> 0"),
    ({"audit_log_path": "a.jsonl", "audit_log_max_bytes": 4096, "audit_log_backups": -1}, ">= 0"),
])
def test_bad_rotation_flags_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ServerConfig(**kwargs)  # type: ignore[arg-type]


def test_a_file_is_rotated_once_its_first_line_is_older_than_the_age_limit(tmp_path: Path) -> None:
    """`--audit-log-max-age-s`, measured by a clock the test sets (no waiting)."""
    path = tmp_path / "audit.jsonl"
    now = [5000.0]
    log = AuditLog(str(path), include_prompts=False, max_age_s=3600.0, clock=lambda: now[0])
    for index in range(10):  # a line every 20 minutes, a file an hour: three lines per file
        log.write(record(index))
        now[0] += 1200.0
    log.close()
    files = all_files(path)
    assert [ids_in(f) for f in files] == [[f"cmpl-{i:05d}" for i in range(start, min(start + 3, 10))]
                                          for start in range(0, 10, 3)]


def test_a_file_found_at_start_ages_from_its_last_write(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b'{"request_id": "old"}\n')
    os.utime(path, (1000.0, 1000.0))
    log = AuditLog(str(path), include_prompts=False, max_age_s=60.0, clock=lambda: 2000.0)
    log.write(record(1))
    log.close()
    assert [ids_in(f) for f in all_files(path)] == [["old"], ["cmpl-00001"]]
