"""The audit log's sink in-process (I8): a full disk, a deleted or rotated file, a missing
directory. Writes never raise; a failing log says why, keeps its records in order, tries the
file again after its back-off and recovers by itself. The full disk is real: the log's path is
a symlink switched to /dev/full, which answers every write with ENOSPC."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvseal.server.audit import AUDIT_UNAVAILABLE, AuditLog, AuditRecord, Outcome

DEV_FULL = "/dev/full"


def record(request_id: str, outcome: Outcome = "finished") -> AuditRecord:
    return AuditRecord(request_id=request_id, endpoint="/v1/completions", tenant="alice", outcome=outcome,
                       received_at=1.0, finished_at=2.0, prompt_tokens=3)


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def point(link: Path, target: str | Path) -> None:
    """Switch the symlink `link` to `target` atomically (as a full disk, or a disk with room again)."""
    tmp = link.with_name(link.name + ".tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


@pytest.fixture
def linked(tmp_path: Path) -> tuple[Path, Path]:
    """(the log's path, a symlink; the real file it names at first)."""
    real, link = tmp_path / "real.jsonl", tmp_path / "audit.jsonl"
    link.symlink_to(real)
    return link, real


def test_a_deleted_or_rotated_file_is_replaced_at_the_path(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), include_prompts=False)
    assert log.write(record("a"))
    path.unlink()  # deleted: the next line must not go to the unlinked file
    assert log.write(record("b"))
    path.rename(tmp_path / "audit.jsonl.1")  # rotated by renaming
    assert log.write(record("c"))
    log.close()
    assert [r["request_id"] for r in lines(path)] == ["c"]
    assert [r["request_id"] for r in lines(tmp_path / "audit.jsonl.1")] == ["b"]


def test_a_full_disk_fails_the_log_until_it_has_room_again(linked: tuple[Path, Path]) -> None:
    link, real = linked
    log = AuditLog(str(link), include_prompts=False, retry_s=0.0)
    assert log.write(record("before")) and log.check() is None
    point(link, DEV_FULL)
    assert not log.write(record("finished-while-full"))
    assert not log.write(record("refused-while-full", "rejected"))
    failure = log.check()
    assert failure is not None and "No space left on device" in failure
    stats = log.stats
    assert not stats.is_up and stats.num_pending == 2 and stats.num_write_failures >= 2
    point(link, real)
    assert log.check() is None and log.stats.is_up and log.stats.num_pending == 0
    assert log.write(record("after"))
    log.close()
    written = lines(real)
    assert [r["request_id"] for r in written] == ["before", "finished-while-full", "refused-while-full", "after"]
    late = written[1]  # its answer was withheld: the late line says so, not "finished"
    assert (late["outcome"], late["reason"], late["written_late"]) == ("error", AUDIT_UNAVAILABLE, True)
    assert (written[2]["outcome"], written[2]["written_late"]) == ("rejected", True)
    assert "written_late" not in written[0] and "written_late" not in written[3]


def test_the_file_is_not_tried_again_before_the_back_off(linked: tuple[Path, Path]) -> None:
    link, real = linked
    log = AuditLog(str(link), include_prompts=False, retry_s=3600.0)
    point(link, DEV_FULL)
    assert not log.write(record("a"))
    point(link, real)  # room again, but the back-off is not over
    assert not log.write(record("b"))
    assert log.check() is not None
    assert log.stats.num_write_failures == 1 and log.stats.num_pending == 2
    assert real.read_text() == ""


def test_a_missing_directory_fails_the_log_and_its_return_recovers_it(tmp_path: Path) -> None:
    folder = tmp_path / "logs"
    folder.mkdir()
    log = AuditLog(str(folder / "audit.jsonl"), include_prompts=False, retry_s=0.0)
    shutil.rmtree(folder)
    assert not log.write(record("a"))
    assert "No such file or directory" in (log.check() or "")
    folder.mkdir()
    assert log.check() is None
    log.close()
    assert [r["request_id"] for r in lines(folder / "audit.jsonl")] == ["a"]


def test_the_failure_clients_see_names_the_reason_but_not_the_path(tmp_path: Path) -> None:
    """The failure goes to tenants and the unauthenticated /health: the server's path stays in its log."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), include_prompts=False, retry_s=0.0)
    assert log.write(record("a"))
    path.unlink()
    path.mkdir()  # the log's path is now a directory
    assert not log.write(record("b"))
    assert log.check() == "cannot write the audit log: Is a directory"


def test_records_beyond_the_queue_are_dropped_and_counted(linked: tuple[Path, Path]) -> None:
    link, real = linked
    log = AuditLog(str(link), include_prompts=False, retry_s=0.0, max_pending=2)
    point(link, DEV_FULL)
    for name in ("a", "b", "c"):
        assert not log.write(record(name))
    assert (log.stats.num_pending, log.stats.num_dropped) == (2, 1)
    point(link, real)
    log.close()
    assert [r["request_id"] for r in lines(real)] == ["a", "b"]


def test_records_beyond_the_queue_s_bytes_are_dropped(linked: tuple[Path, Path]) -> None:
    link, real = linked
    log = AuditLog(str(link), include_prompts=False, retry_s=0.0, max_pending_bytes=300)
    point(link, DEV_FULL)
    for name in ("a", "b", "c"):  # a late line is about 200 bytes
        assert not log.write(record(name))
    assert (log.stats.num_pending, log.stats.num_dropped) == (1, 2)


def test_without_a_file_the_lines_go_to_the_logger(caplog: pytest.LogCaptureFixture) -> None:
    log = AuditLog(None, include_prompts=False)
    with caplog.at_level("INFO", logger="kvseal.audit"):
        assert log.write(record("a"))
    assert json.loads(caplog.records[-1].getMessage())["request_id"] == "a"


@pytest.fixture
def open_umask() -> Any:
    """umask 000: any mode the log's files get is the one the code asks for."""
    old = os.umask(0)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_the_file_is_the_server_users_alone_at_start_after_rotation_and_after_deletion(
        tmp_path: Path, open_umask: None) -> None:
    """It holds every tenant's request records (and, with --audit-log-prompts, their prompts)."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), include_prompts=True, max_bytes=400)
    assert log.write(record("a"))
    assert _mode(path) == 0o600
    for i in range(4):  # past max_bytes: rotated, and a new file made at the path
        assert log.write(record(f"r{i}"))
    path.unlink()
    assert log.write(record("after-deletion"))
    log.close()
    files = [p for p in tmp_path.iterdir() if p.name.startswith("audit.jsonl")]
    assert len(files) >= 3 and {_mode(p) for p in files} == {0o600}


def test_a_file_found_open_to_other_users_loses_their_access_and_says_so(
        tmp_path: Path, open_umask: None, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text("")
    path.chmod(0o644)  # as kvseal made it before, under the usual umask
    log = AuditLog(str(path), include_prompts=False)
    with caplog.at_level("WARNING", logger="kvseal.audit"):
        assert log.write(record("a"))
    log.close()
    assert _mode(path) == 0o640  # the group's read is the operator's choice
    assert "was open to other users (mode 644); it is now 640" in caplog.text
    assert [r["request_id"] for r in lines(path)] == ["a"]

