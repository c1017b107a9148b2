"""The restart policy: backoff doubling to its cap, the limit in a row, a stable run ending the
row, exits in words, and bad flags refused."""

from __future__ import annotations

import pytest

from kvseal.cli import main
from kvseal.engine import supervisor
from kvseal.engine.supervisor import MAX_BACKOFF_S, RestartPolicy, RestartTracker, describe_exit
from kvseal.errors import ConfigError


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(engine_restart_limit=10, engine_restart_backoff_s=1.5)
    assert [policy.delay_s(n) for n in (1, 2, 3)] == [1.5, 3.0, 6.0]
    assert policy.delay_s(10) == MAX_BACKOFF_S


def test_the_limit_counts_restarts_in_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(supervisor.time, "monotonic", lambda: now[0])
    tracker = RestartTracker(RestartPolicy(engine_restart_limit=2, engine_restart_backoff_s=1.0))
    tracker.started()
    assert tracker.next_delay_s() == 1.0
    tracker.started()
    assert tracker.next_delay_s() == 2.0
    tracker.started()
    assert tracker.next_delay_s() is None and "2 times in a row" in tracker.gave_up()
    now[0] += supervisor.STABLE_AFTER_S  # the last restart stayed up long enough: a new row
    assert tracker.next_delay_s() == 1.0 and tracker.num_restarts == 3


def test_limit_zero_never_restarts() -> None:
    tracker = RestartTracker(RestartPolicy(engine_restart_limit=0))
    assert tracker.next_delay_s() is None
    assert tracker.gave_up() == "not restarted (--engine-restart-limit 0): restart the server"


def test_exits_in_words() -> None:
    assert describe_exit(-9) == "killed by SIGKILL (signal 9)"
    assert describe_exit(1) == "exit code 1" and describe_exit(None) == "exit status unknown"


@pytest.mark.parametrize("kwargs, flag", [({"engine_restart_limit": -1}, "--engine-restart-limit"),
                                          ({"engine_restart_backoff_s": -1.0}, "--engine-restart-backoff-s"),
                                          ({"engine_restart_backoff_s": float("inf")}, "--engine-restart-backoff-s"),
                                          ({"engine_timeout_s": 1.0}, "--engine-timeout-s"),
                                          ({"engine_timeout_s": float("nan")}, "--engine-timeout-s"),
                                          ({"engine_timeout_s": True}, "--engine-timeout-s")])
def test_bad_flags_are_refused(kwargs: dict[str, float], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("argv, message", [
    (["serve", "--engine-restart-limit", "-1"], "--engine-restart-limit must be an integer >= 0"),
    (["serve", "--engine-timeout-s", "0.5"], "--engine-timeout-s must be a number of seconds >= 2"),
    (["serve", "--audit-log-max-bytes", "10MiB"], "--audit-log-max-bytes rotates the audit log file: give --audit-log"),
])
def test_bad_serve_flags_stop_start_up_with_one_line(argv: list[str], message: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert f"kvseal: error: {message}" in capsys.readouterr().err


def test_an_unreadable_size_is_the_flags_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--audit-log", "a.jsonl", "--audit-log-max-bytes", "lots"])
    assert exit_info.value.code == 2
    assert "argument --audit-log-max-bytes: cannot read 'lots' as a size" in capsys.readouterr().err


def test_one_restart_is_one_time() -> None:
    tracker = RestartTracker(RestartPolicy(engine_restart_limit=1, engine_restart_backoff_s=1.0))
    tracker.started()
    assert tracker.next_delay_s() == 1.0
    tracker.started()
    assert tracker.next_delay_s() is None and "restarted 1 time in a row" in tracker.gave_up()
