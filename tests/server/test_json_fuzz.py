"""Hypothesis-generated request bodies and raw bytes: always an answer below 500, never a hang.

Requests run as tenant `fuzz`, whose max_tokens cap (8) keeps each generation short; every
call has a timeout, so a hang fails the test.
"""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_process import ServerProcess

FUZZ_HEADERS = {"Authorization": "Bearer key-fuzz", "content-type": "application/json"}

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
