"""The tenant concurrency cap counts sequences: a request with n choices takes n slots (each
choice is a request in the engine; counted as one, a tenant at its cap could fill the whole
batch with n=16 requests)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from processes import wait_for
from server_process import ServerProcess

FOUR = {"Authorization": "Bearer key-four"}
OTHER = {"Authorization": "Bearer key-other"}


@pytest.fixture(scope="module")
def capped_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    keys = {"key-four": {"tenant": "four", "max_concurrent_requests": 4}, "key-other": {"tenant": "other"}}
    proc = ServerProcess(server_model_dir, tmp_path_factory.mktemp("capped"), keys=keys).start()
    yield proc
    proc.terminate()


def _post(server: ServerProcess, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/completions", json={"prompt": "w5", "max_tokens": 2} | body,
                      headers=headers, timeout=60)


def _error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    return dict(error)


def test_choices_in_flight_count_against_the_cap(capped_server: ServerProcess) -> None:
    """A streaming request with n=3 holds three of the tenant's four slots: another with n=2
    is refused while it runs, one with n=1 still fits, and another tenant is not affected."""
    body = {"max_tokens": 400, "ignore_eos": True, "stream": True, "n": 3}
    with httpx.stream("POST", f"{capped_server.base_url}/completions", json={"prompt": "w5"} | body, headers=FOUR,
                      timeout=60) as first:
        lines = first.iter_lines()
        next(lines)  # in flight
        refused = _post(capped_server, {"n": 2}, FOUR)
        assert "no room for 2 more" in _error(refused)["message"] and refused.headers["retry-after"] == "1"
        assert _post(capped_server, {"n": 1}, FOUR).status_code == 200
        assert _post(capped_server, {"n": 16}, OTHER).status_code == 200  # the default cap, 64
        list(lines)
    wait_for(lambda: _post(capped_server, {"n": 4}, FOUR).status_code == 200, "the four slots to come back")


def test_a_request_with_more_choices_than_the_cap_is_refused_for_good(capped_server: ServerProcess) -> None:
    refused = _post(capped_server, {"n": 5}, FOUR)
    error = _error(refused)
    assert "its 5 choices" in error["message"] and "fewer choices" in error["message"]
    assert "retry-after" not in refused.headers  # waiting cannot help
    assert _post(capped_server, {"n": 4}, FOUR).status_code == 200  # nothing was left taken
