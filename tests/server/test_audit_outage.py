"""No answer without its audit line (I8), and no restart needed after the audit log fails:
the outage of `audit_outage.py` against a colocated server, and the same outage against a
server that ignores failed audit writes (the behaviour before the guard), which it must catch."""

from __future__ import annotations

from pathlib import Path

import pytest
from audit_outage import Outage, linked_audit_log, play_outage
from server_process import KEYS, ServerProcess


def _outage_server(model_dir: Path, workdir: Path, faults: list[str] | None = None) -> tuple[ServerProcess, Outage]:
    link, real = linked_audit_log(workdir)
    server = ServerProcess(model_dir, workdir, keys=KEYS, faults=faults)
    assert server.audit_path == link
    server.start()
    return server, Outage(server.url, link, real, "key-alice", "key-ops")


def test_a_failing_audit_log_withholds_answers_refuses_requests_and_recovers(server_model_dir: Path,
                                                                             tmp_path: Path) -> None:
    server, outage = _outage_server(server_model_dir, tmp_path)
    try:
        play_outage(outage)
    finally:
        assert server.terminate() == 0


def test_the_outage_test_fails_when_failed_audit_writes_are_ignored(server_model_dir: Path, tmp_path: Path) -> None:
    """The guard of the guard: a server that answers whether or not the line was written."""
    server, outage = _outage_server(server_model_dir, tmp_path, faults=["ignore_audit_failure"])
    try:
        with pytest.raises(AssertionError, match="answered 200 without its audit line"):
            play_outage(outage)
    finally:
        assert server.terminate() == 0
