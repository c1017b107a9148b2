"""`kvseal serve -tp 2`: the HTTP server over a tensor-parallel engine, and its failure path.

A rank that dies mid-stream fails the engine closed: the stream ends with an error event (never
a finish from a half-computed step), /health says 503, and no request hangs. A new server
serves again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "server"))

from processes import process_gone, wait_for  # noqa: E402
from server_process import ServerProcess  # noqa: E402
from tiny_server_model import make_server_model  # noqa: E402

from kvseal.messages.msgs import TP_RANK_LOST  # noqa: E402

BODY = {"prompt": "w5 w6", "max_tokens": 400, "ignore_eos": True, "stream": True}
TP_FLAGS = ["--tensor-parallel-size", "2", "--tp-timeout", "10"]
NO_RESTART = ["--engine-restart-limit", "0"]  # these tests look at the failed state itself


@pytest.fixture
def tp_server(tmp_path: Path) -> Iterator[ServerProcess]:
    model = make_server_model(tmp_path / "tiny-llama")
    proc = ServerProcess(model, tmp_path / "server", extra_args=[*TP_FLAGS, *NO_RESTART]).start()
    yield proc
    proc.stop()  # SIGTERM: a frontend whose engine already failed still removes the engine's socket folder


def _rank_pids(server: ServerProcess) -> list[int]:
    found = wait_for(lambda: re.search(r"tensor parallel: 2 ranks \(pids \[([\d, ]+)\]\)", server.log()),
                     "the engine's tensor-parallel start-up line")
    return [int(p) for p in found.group(1).split(",")]


def assert_plain_rank_lost(message: str, server: ServerProcess) -> None:
    """Clients (and the unauthenticated /health) get the plain reason; gloo's error, with its
    source paths, loopback ports and PIDs, is only in the server's log."""
    assert TP_RANK_LOST in message, message
    assert not re.search(r"gloo|\.cc\b|127\.0\.0\.1|:\d{4,5}\b|pid", message), message
    assert "a tensor-parallel rank failed; stopping the ranks (pids" in server.log()
    assert "RankFailure: rank 0: " in server.log()  # the exception, in the traceback


def test_tp2_server_answers_like_tp1_and_fails_closed_when_a_rank_dies(tp_server: ServerProcess,
                                                                       tmp_path: Path) -> None:
    body = {"prompt": "w5 w6 w7", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    sampled = {"prompt": "w9 w10", "max_tokens": 6, "temperature": 0.9, "seed": 5, "n": 2, "logprobs": 2}
    got = [httpx.post(f"{tp_server.base_url}/completions", json=b, timeout=60).json() for b in (body, sampled)]
    one = ServerProcess(make_server_model(tmp_path / "tiny-llama-1"), tmp_path / "one").start()
    try:
        ref = [httpx.post(f"{one.base_url}/completions", json=b, timeout=60).json() for b in (body, sampled)]
    finally:
        one.stop()
    for g, r in zip(got, ref):
        assert [c["text"] for c in g["choices"]] == [c["text"] for c in r["choices"]]
    assert len(got[1]["choices"]) == 2
    assert [c["logprobs"]["tokens"] for c in got[1]["choices"]] == [c["logprobs"]["tokens"] for c in ref[1]["choices"]]
    (rank_pid,) = _rank_pids(tp_server)
    with httpx.stream("POST", f"{tp_server.base_url}/completions", json=BODY, timeout=60) as response:
        lines = response.iter_lines()
        next(lines)
        os.kill(rank_pid, signal.SIGKILL)
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "error" in events[-1] and events[-1]["error"]["code"] == "engine_unavailable"
    assert_plain_rank_lost(events[-1]["error"]["message"], tp_server)
    assert not any(e.get("choices", [{}])[0].get("finish_reason") for e in events[:-1])
    health = httpx.get(f"{tp_server.url}/health", timeout=10)
    assert health.status_code == 503
    assert_plain_rank_lost(health.json()["error"]["message"], tp_server)
    assert httpx.post(f"{tp_server.base_url}/completions", json=body, timeout=60).status_code == 503


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_rank_lost_while_idle_turns_health_503(tp_server: ServerProcess, how: str) -> None:
    """No request in flight: the driver's keep-alive finds the lost rank within --tp-timeout."""
    (rank_pid,) = _rank_pids(tp_server)
    assert httpx.get(f"{tp_server.url}/health", timeout=10).status_code == 200
    os.kill(rank_pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    health = wait_for(lambda: (r := httpx.get(f"{tp_server.url}/health", timeout=10)).status_code == 503 and r,
                      "health 503 after the rank was lost")
    assert_plain_rank_lost(health.json()["error"]["message"], tp_server)
    body = {"prompt": "w5", "max_tokens": 2}
    assert httpx.post(f"{tp_server.base_url}/completions", json=body, timeout=60).status_code == 503
    wait_for(lambda: process_gone(rank_pid), "the lost rank stopped by its PID")


def test_a_supervised_tp_engine_restarts_with_new_ranks_and_serves_again(tmp_path: Path) -> None:
    """With restarts on, the engine that failed closed is started again, ranks and all."""
    model = make_server_model(tmp_path / "tiny-llama")
    server = ServerProcess(model, tmp_path / "server", extra_args=[*TP_FLAGS, "--engine-restart-limit", "2",
                                                                   "--engine-restart-backoff-s", "0"]).start()
    try:
        body = {"prompt": "w5 w6 w7", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        before = httpx.post(f"{server.base_url}/completions", json=body, timeout=60).json()
        (first_rank,) = _rank_pids(server)
        with httpx.stream("POST", f"{server.base_url}/completions", json=BODY, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)
            os.kill(first_rank, signal.SIGKILL)
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert "error" in events[-1]
        found = wait_for(lambda: len(re.findall(r"tensor parallel: 2 ranks \(pids \[(\d+)\]\)", server.log())) > 1
                         and re.findall(r"tensor parallel: 2 ranks \(pids \[(\d+)\]\)", server.log()),
                         "the restarted engine's ranks", deadline_s=180)
        assert int(found[-1]) != first_rank
        wait_for(lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 200, "health 200 again",
                 deadline_s=180)
        after = httpx.post(f"{server.base_url}/completions", json=body, timeout=60).json()
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
    finally:
        server.stop()
