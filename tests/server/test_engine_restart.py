"""Supervised colocated engine: an engine killed by its PID is reaped and restarted with
backoff; the requests it held and those sent meanwhile get errors (never a 200 with wrong
text), then the server serves the same answers again; past the restart limit it stays down
with a 503 that says why. A hung (SIGSTOPped) engine is noticed by its silence, killed by its
PID and handled as one that crashed. (With restarts off, --engine-restart-limit 0, the 503 that
says to restart the server: tests/server/test_lifecycle.py::test_engine_death_fails_requests_and_health.)"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from processes import wait_for
from server_process import ServerProcess

from kvseal.cli import main

PROMPT = {"prompt": "w5 w6 w7", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
LONG = {"prompt": "w5 w6", "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture
def start_server(server_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def start(*extra_args: str) -> ServerProcess:
        started.append(ServerProcess(server_model_dir, tmp_path / str(len(started)), extra_args=list(extra_args)))
        return started[-1].start()

    yield start
    for proc in started:
        proc.stop()  # SIGTERM (then SIGKILL): the server removes its engine's socket folder


def is_reaped(pid: int) -> bool:
    """The process is gone, not a <defunct> zombie waiting for its parent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def kill_mid_stream(server: ServerProcess, pid: int, sig: signal.Signals = signal.SIGKILL) -> dict[str, object]:
    """Send `sig` to the engine while a stream runs; the stream's last event (an error)."""
    with httpx.stream("POST", f"{server.base_url}/completions", json=LONG, timeout=60) as response:
        lines = response.iter_lines()
        next(lines)
        os.kill(pid, sig)
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return events[-1]


def answer(server: ServerProcess) -> tuple[int, str]:
    response = httpx.post(f"{server.base_url}/completions", json=PROMPT, timeout=60)
    if response.status_code != 200:
        assert response.json()["error"]["code"] == "engine_unavailable", response.text
        return response.status_code, response.json()["error"]["message"]
    return 200, response.json()["choices"][0]["text"]


def restarted_pids(server: ServerProcess) -> list[int]:
    return [int(pid) for pid in re.findall(r"restarting the engine \(pid (\d+)\)", server.log())]


def test_a_killed_engine_is_reaped_restarted_and_serves_the_same_answers(
        start_server: Callable[..., ServerProcess], capsys: pytest.CaptureFixture[str]) -> None:
    server = start_server("--engine-restart-backoff-s", "1")
    status, before = answer(server)
    assert status == 200
    old_pid = server.engine_pid
    last = kill_mid_stream(server, old_pid)
    assert last["error"]["code"] == "engine_unavailable"  # type: ignore[index]
    assert "killed by SIGKILL (signal 9)" in last["error"]["message"]  # type: ignore[index]
    [new_pid] = wait_for(lambda: restarted_pids(server), "the restart")
    os.kill(new_pid, signal.SIGSTOP)  # held before it is ready: what clients are told meanwhile
    try:
        status, text = answer(server)
        health = httpx.get(f"{server.url}/health", timeout=10).json()["error"]["message"]
    finally:
        os.kill(new_pid, signal.SIGCONT)
    assert status == 503 and text == health
    assert re.search(r"restarted at \d\d:\d\d:\d\d UTC, waiting for it to answer\. Retry later\.$", text), text
    meanwhile: list[tuple[int, str]] = []  # while it restarts, 503 naming why; then the same answer as before
    wait_for(lambda: meanwhile.append(answer(server)) or meanwhile[-1][0] == 200, "serving again")
    assert meanwhile[-1] == (200, before), meanwhile[-3:]
    for status, text in meanwhile[:-1]:
        assert status == 503 and "exited unexpectedly (killed by SIGKILL (signal 9))" in text, text
    assert is_reaped(old_pid)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert server.metric('kvseal_engine_restarts_total{role="engine"}') == 1
    assert server.metric("kvseal_engine_up") == 1
    assert restarted_pids(server) == [new_pid]
    assert new_pid != old_pid and os.path.exists(f"/proc/{new_pid}")
    records = server.audit_records()
    errors = [r for r in records if r["outcome"] == "error"]
    assert errors and all(r.get("output_tokens", 0) < LONG["max_tokens"] for r in errors)  # type: ignore[operator]
    # the audit names the engine process: the dead one's requests are one query away; their reason is
    # the code the requests refused meanwhile have too, the exit in words beside it
    assert {r["engine"] for r in records if r["outcome"] == "finished"} == {f"engine-{old_pid}", f"engine-{new_pid}"}
    assert "killed by SIGKILL (signal 9)" in errors[0]["detail"]
    assert main(["audit", "--audit-log", str(server.audit_path), "--engine", f"engine-{old_pid}", "--outcome",
                 "error", "--reason", "engine_unavailable", "--format", "json"]) == 0
    found = json.loads(capsys.readouterr().out)["requests"]
    assert [r["request_id"] for r in found] == [errors[0]["request_id"]]


def test_past_the_restart_limit_the_engine_stays_down_with_a_reason(
        start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--engine-restart-limit", "1", "--engine-restart-backoff-s", "0")
    os.kill(server.engine_pid, signal.SIGKILL)
    wait_for(lambda: restarted_pids(server) and answer(server)[0] == 200, "the restarted engine")
    [pid] = restarted_pids(server)
    os.kill(pid, signal.SIGTERM)  # the engine ignores SIGTERM: only a kill stops it
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: "not restarted again" in answer(server)[1], "the given-up 503")
    health = httpx.get(f"{server.url}/health", timeout=10)
    message = health.json()["error"]["message"]
    assert health.status_code == 503 and "--engine-restart-limit 1" in message
    assert "Retry later" not in message  # retrying cannot help: it says to restart the server
    assert is_reaped(pid) and len(restarted_pids(server)) == 1
    assert server.metric("kvseal_engine_up") == 0
    assert server.terminate() == 0


def test_a_hung_engine_is_killed_and_restarted(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--engine-timeout-s", "3", "--engine-restart-backoff-s", "0")
    status, before = answer(server)
    assert status == 200
    old_pid = server.engine_pid
    last = kill_mid_stream(server, old_pid, signal.SIGSTOP)  # stopped, not dead: only its silence tells
    assert last["error"]["code"] == "engine_unavailable"  # type: ignore[index]
    assert "the engine process stopped responding" in last["error"]["message"]  # type: ignore[index]
    assert "--engine-timeout-s 3" in last["error"]["message"]  # type: ignore[index]
    assert is_reaped(old_pid)
    assert f"ERROR kvseal.server: the engine process (pid {old_pid}) has sent nothing" in server.log()
    wait_for(lambda: answer(server)[0] == 200, "serving again")
    assert answer(server) == (status, before)
    # at least the one restart: on a loaded host the new engine may itself fall silent past 3 s and be
    # restarted again, which is the same rule at work
    assert server.metric('kvseal_engine_restarts_total{role="engine"}') >= 1
    assert old_pid not in restarted_pids(server)


def test_a_hung_engine_without_restarts_leaves_the_server_unhealthy_with_a_reason(
        start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--engine-timeout-s", "3", "--engine-restart-limit", "0")
    pid = server.engine_pid
    os.kill(pid, signal.SIGSTOP)
    health = wait_for(lambda: (h := httpx.get(f"{server.url}/health", timeout=10)).status_code == 503 and h,
                      "/health 503")
    assert "the engine process stopped responding" in health.json()["error"]["message"]
    assert server.metric("kvseal_engine_up") == 0
    wait_for(lambda: is_reaped(pid), "the hung engine killed and reaped")
    assert server.terminate() == 0
