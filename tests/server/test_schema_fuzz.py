"""Generated requests against the server's own OpenAPI schema: no input yields a 5xx or a hang.

Schemathesis draws valid and invalid bodies for every operation; a hypothesis test adds
arbitrary JSON and raw bytes. Requests run as tenant `fuzz`, whose max_tokens cap (8)
keeps each generation short; every call has a timeout, so a hang fails the test.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from server_process import ServerProcess

FUZZ_HEADERS = {"Authorization": "Bearer key-fuzz"}
schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture
def api_schema(server: ServerProcess) -> Any:
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_schema_generated_requests_never_fail_the_server(case: Any) -> None:
    response = case.call(headers=FUZZ_HEADERS, timeout=30)
    case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(["prompt", "messages", "max_tokens", "temperature", "top_p", "stop", "stream", "seed",
                          "logprobs", "min_tokens", "ignore_eos", "stream_options", "n", "model", "top_logprobs"])
bodies = st.dictionaries(fields, json_values, max_size=6)


@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=bodies)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_arbitrary_json_bodies_get_an_answer_below_500(server: ServerProcess, path: str, body: dict) -> None:
    response = httpx.post(f"{server.url}{path}", content=json.dumps(body), headers=FUZZ_HEADERS, timeout=30)
    assert response.status_code < 500, response.text


@given(raw=st.binary(max_size=64))
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_arbitrary_bytes_get_a_400(server: ServerProcess, raw: bytes) -> None:
    response = httpx.post(f"{server.url}/v1/completions", content=raw, headers=FUZZ_HEADERS, timeout=30)
    assert response.status_code == 400, response.text
