"""Isolation events an operator sees: a tripped isolation check ends the request with HTTP 500
`isolation_check_failed` (an SSE error event when streaming), an audit record with outcome
`isolation_violation` and the reason, an ERROR line in the frontend's log, and
`kvseal_isolation_violations_total` in /metrics.

Each fault switch runs in a real server (tests/fault_launcher.py turns it on in the engine
process too), in the default configuration and in checked mode. The default configuration
relies on the engine's always-on coverage check (branch `coverage`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import ISOLATION_MODES, KEYS, ServerProcess

FAULTS = ("placeholder_prefill", "foreign_page")
BOB = {"Authorization": "Bearer key-bob"}
VICTIM = {"prompt": "w10 w11 w12 w13 w14 w15 w16 w17 w18", "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module", params=[(f, m) for f in FAULTS for m in ISOLATION_MODES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def fault_server(request: pytest.FixtureRequest, server_model_dir: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ServerProcess]]:
    fault, mode = request.param
    proc = ServerProcess(server_model_dir, tmp_path_factory.mktemp(f"{fault}-{mode}"), keys=KEYS,
                         extra_args=ISOLATION_MODES[mode], faults=[fault])
    proc.start()
    yield fault, proc
    proc.terminate()


@contextlib.contextmanager
def _neighbour(server: ServerProcess, fault: str) -> Iterator[None]:
    """For the foreign-page fault: another tenant's request holds live pages meanwhile."""
    if fault != "foreign_page":
        yield
        return
    body = {"prompt": "w300 w301 w302", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer key-alice"}) as response:
        lines = response.iter_lines()
        next(lines)  # alice is generating: her pages are live
        yield


def _events(response: httpx.Response) -> list[str]:
    return [line for line in response.iter_lines() if line.startswith("data: ")]


def _assert_violation_recorded(server: ServerProcess, request_id: str) -> None:
    record = server.audit_for(request_id)
    assert record["outcome"] == "isolation_violation" and record["http_status"] == 500, record
    assert "isolation" in record["reason"] and record["tenant"] == "bob"


def test_a_tripped_isolation_check_is_an_error_everyone_sees(fault_server: tuple[str, ServerProcess]) -> None:
    fault, server = fault_server
    with _neighbour(server, fault):
        response = httpx.post(f"{server.base_url}/completions", json=VICTIM, headers=BOB, timeout=60)
    assert response.status_code == 500, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == "isolation_check_failed" and error["type"] == "server_error"
    _assert_violation_recorded(server, response.headers["x-request-id"])

    with _neighbour(server, fault), httpx.stream("POST", f"{server.base_url}/completions",
                                                 json=VICTIM | {"stream": True}, headers=BOB,
                                                 timeout=60) as stream:
        events = _events(stream)
        stream_id = stream.headers["x-request-id"]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "isolation_check_failed"
    assert not any('"finish_reason": "length"' in e or '"finish_reason":"length"' in e for e in events)
    _assert_violation_recorded(server, stream_id)

    assert server.metric("kvseal_isolation_violations_total") >= 2
    log = server.log()
    assert "ERROR kvseal.server: ISOLATION VIOLATION" in log and stream_id in log
