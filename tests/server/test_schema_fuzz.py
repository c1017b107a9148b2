"""Schemathesis against the server's own OpenAPI schema: no input yields a 5xx or a hang.

It draws valid and invalid bodies for every operation. Requests run as tenant `fuzz`, whose
max_tokens cap (8) keeps each generation short; every call has a timeout, so a hang fails.
Schemathesis belongs in the `test` extra; where it is missing, this file is skipped (the
hypothesis fuzzing in test_json_fuzz.py still runs).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from server_process import ServerProcess

schemathesis = pytest.importorskip("schemathesis", reason="pip install schemathesis (the `test` extra)")
from schemathesis.checks import not_a_server_error  # noqa: E402

FUZZ_HEADERS = {"Authorization": "Bearer key-fuzz"}
schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture
def api_schema(server: ServerProcess) -> Any:
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=FUZZ_HEADERS)  # it needs a key


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_schema_generated_requests_never_fail_the_server(case: Any) -> None:
    response = case.call(headers=FUZZ_HEADERS, timeout=30)
    case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
