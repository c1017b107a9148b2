"""Isolation events an operator sees: a tripped isolation check ends the request with HTTP 500
`isolation_check_failed` (an SSE error event when streaming), an audit record with outcome
`isolation_violation` and the reason, an ERROR line in the frontend's log, and
`kvseal_isolation_violations_total` in /metrics.

Each fault switch runs in a real server (tests/fault_launcher.py turns it on in the engine
process too), in the default configuration and in checked mode. The default configuration
relies on the engine's always-on coverage check (branch `coverage`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

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


def _bob(server: ServerProcess, stream: bool) -> tuple[str, str | None]:
    """Bob's request: its id and its error code (None for a normal finish)."""
    if not stream:
        response = httpx.post(f"{server.base_url}/completions", json=VICTIM, headers=BOB, timeout=60)
        if response.status_code == 200:
            return response.headers["x-request-id"], None
        assert response.status_code == 500, response.text
        assert response.json()["error"]["type"] == "server_error"
        return response.headers["x-request-id"], response.json()["error"]["code"]
    with httpx.stream("POST", f"{server.base_url}/completions", json=VICTIM | {"stream": True}, headers=BOB,
                      timeout=60) as response:
        return response.headers["x-request-id"], _stream_error(response.iter_lines())


def _stream_error(lines: Iterator[str]) -> str | None:
    """The error code a stream ended with (None if it finished normally); it always ends with [DONE]."""
    events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    if "error" in last:
        assert not any(json.loads(e[6:]).get("choices", [{}])[0].get("finish_reason") for e in events[:-2])
        return str(last["error"]["code"])
    return None


def _scenario(server: ServerProcess, fault: str, stream: bool) -> dict[str, str | None]:
    """Run bob's request under the fault; every request involved → its error code.

    For the foreign-page fault alice is mid-generation meanwhile (her pages are live): the
    corrupted block tables name each other's pages, and the check catches whichever reads first.
    """
    if fault != "foreign_page":
        return dict([_bob(server, stream)])
    body = {"prompt": "w300 w301 w302", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer key-alice"}) as response:
        lines = response.iter_lines()
        first = next(lines)  # alice is generating
        bob_id, bob_error = _bob(server, stream)
        return {bob_id: bob_error, response.headers["x-request-id"]: _stream_error(iter([first, *lines]))}


def _tripping(server: ServerProcess, fault: str, stream: bool) -> dict[str, str | None]:
    """The scenario, run again (five times at most) until a check trips, with every request of
    every run: the foreign-page fault needs alice still generating when bob's request runs, and
    the tiny model can decode all her tokens first (then no page of hers is there to name)."""
    results: dict[str, str | None] = {}
    for _ in range(5):
        results |= _scenario(server, fault, stream)
        if any(results.values()):
            break
    return results


def test_a_tripped_isolation_check_is_an_error_everyone_sees(fault_server: tuple[str, ServerProcess]) -> None:
    fault, server = fault_server
    plain, streamed = _tripping(server, fault, stream=False), _tripping(server, fault, stream=True)
    assert any(plain.values()) and any(streamed.values()), (plain, streamed)  # each scenario trips a check
    results = plain | streamed
    caught = [request_id for request_id, code in results.items() if code is not None]
    assert all(results[request_id] == "isolation_check_failed" for request_id in caught), results
    for request_id in caught:
        record = server.audit_for(request_id)
        assert record["outcome"] == "isolation_violation" and record["http_status"] == 500, record
        assert "isolation" in record["reason"]
    assert server.metric("kvseal_isolation_violations_total") == len(caught)
    log = server.log()
    assert all(f"ERROR kvseal.server: ISOLATION VIOLATION: request {request_id}" in log for request_id in caught)
