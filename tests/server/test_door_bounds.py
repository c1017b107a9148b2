"""Every body field has a bound, /tokenize and /detokenize leave audit records, one
Authorization header per request, and the OpenAPI document behind a key.

The checks that guard shared resources at the door each run twice: against the shared server,
and against one started with the test-only `SKIP_DOOR_CHECKS` fault, where they must fail."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import KEYS, MAX_BODY_BYTES, MAX_MODEL_LEN, ServerProcess
from test_http_errors import ALICE, error_of

from kvseal.server.body import parse_body
from kvseal.server.errors import ApiError
from kvseal.server.protocol import (
    INT32_MAX,
    MAX_ARGUMENTS_DEPTH,
    MAX_CONTENT_PARTS,
    MAX_DESCRIPTION_CHARS,
    MAX_FUNCTION_NAME_CHARS,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_STOP_CHARS,
    MAX_TOKEN_ID_DIGITS,
    MAX_TOOLS,
    ChatCompletionRequest,
    CompletionRequest,
)
from kvseal.server.tokenize_routes import DetokenizeBody, TokenizeChatBody

TWO_KEYS = [("Authorization", "Bearer key-alice"), ("Authorization", "Bearer key-bob")]
BIG_TEXT = "x" * 100_000  # more than a 512-token prompt of this model can hold


def post(server: ServerProcess, path: str, body: Any, headers: Any = None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=ALICE if headers is None else headers, timeout=60)


# ---- the checks (each must fail against a server without them) ----------------------------


def assert_detokenize_is_bounded(server: ServerProcess) -> None:
    """At most as many ids as a prompt; refused from a scan for a big body; audited with the count."""
    for num_ids in (MAX_MODEL_LEN + 1, 200_000):  # a small body, then one the pre-scan refuses
        response = post(server, "/detokenize", {"tokens": [10] * num_ids})
        err = error_of(response, 400)
        assert err["param"] == "tokens" and str(num_ids) in err["message"] and str(MAX_MODEL_LEN) in err["message"]
        record = server.audit_for(response.headers["x-request-id"])
        assert (record["endpoint"], record["outcome"], record["prompt_tokens"]) == ("/detokenize", "rejected",
                                                                                     num_ids)
    assert post(server, "/detokenize", {"tokens": [10] * MAX_MODEL_LEN}).status_code == 200  # the limit itself


def assert_two_authorization_headers_are_refused(server: ServerProcess) -> None:
    response = post(server, "/v1/completions", {"prompt": "w5", "max_tokens": 1}, TWO_KEYS)
    assert error_of(response, 400)["code"] == "duplicate_authorization"
    assert server.audit_for(response.headers["x-request-id"])["reason"] == "duplicate_authorization"
    assert error_of(post(server, "/tokenize", {"prompt": "w5"}, TWO_KEYS), 400)["code"] == "duplicate_authorization"
    for path in ("/v1/models", "/metrics", "/openapi.json"):
        response = httpx.get(f"{server.url}{path}", headers=TWO_KEYS, timeout=10)
        assert error_of(response, 400)["code"] == "duplicate_authorization", path


def assert_openapi_needs_a_key(server: ServerProcess) -> None:
    url = f"{server.url}/openapi.json"
    assert error_of(httpx.get(url, timeout=10), 401)["code"] == "invalid_api_key"
    assert error_of(httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=10), 401)
    document = httpx.get(url, headers=ALICE, timeout=10)
    assert document.status_code == 200 and "/v1/chat/completions" in document.json()["paths"]
    for page in ("/docs", "/redoc", "/docs/oauth2-redirect"):  # not served at all
        assert error_of(httpx.get(f"{server.url}{page}", headers=ALICE, timeout=10), 404)["code"] == "not_found"


def assert_template_text_is_bounded(server: ServerProcess) -> None:
    """Tool definitions, tool-call arguments, refusals and reasoning are rendered into the prompt:
    no more than it holds."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"description": BIG_TEXT[:60_000]}}}
             for i in range(2)]
    chat = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 1}
    err = error_of(post(server, "/v1/chat/completions", chat | {"tools": tools}), 400)
    assert err["param"] == "tools" and "tool definitions" in err["message"] and "512 tokens" in err["message"]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": BIG_TEXT})}}
    messages = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    for path, body in (("/v1/chat/completions", {"messages": messages, "max_tokens": 1}),
                       ("/tokenize", {"messages": messages})):
        err = error_of(post(server, path, body), 400)
        assert err["param"] == "messages" and "arguments" in err["message"], path
    for field in ("refusal", "reasoning", "reasoning_content"):  # rendered too, for templates that read them
        messages = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": None, field: BIG_TEXT}]
        err = error_of(post(server, "/tokenize", {"messages": messages}), 400)
        assert err["param"] == "messages" and "refusals and reasoning" in err["message"], field
    small = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert post(server, "/v1/chat/completions", chat | {"tools": small}).status_code == 200  # within the bound


DOOR_CHECKS: list[Callable[[ServerProcess], None]] = [
    assert_detokenize_is_bounded, assert_two_authorization_headers_are_refused, assert_openapi_needs_a_key,
    assert_template_text_is_bounded,
]


# Tools are bounded only on a server that parses tool calls (elsewhere a request with tools is
# refused before its tools are looked at), so both servers here parse them.
SERVER_ARGS = ["--max-body-bytes", str(MAX_BODY_BYTES), "--tool-call-parser", "hermes"]


@pytest.fixture(scope="module")
def server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(server_model_dir, tmp_path_factory.mktemp("door"), keys=KEYS, extra_args=SERVER_ARGS)
    proc.start()
    yield proc
    assert proc.terminate() == 0


@pytest.mark.parametrize("check", DOOR_CHECKS, ids=lambda check: check.__name__)
def test_the_door_checks_hold(server: ServerProcess, check: Callable[[ServerProcess], None]) -> None:
    check(server)


@pytest.fixture(scope="module")
def unguarded(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(server_model_dir, tmp_path_factory.mktemp("unguarded"), keys=KEYS, extra_args=SERVER_ARGS,
                         faults=["skip_door_checks"])
    proc.start()
    yield proc
    assert proc.terminate() == 0


@pytest.mark.parametrize("check", DOOR_CHECKS, ids=lambda check: check.__name__)
def test_each_door_check_fails_without_its_guard(unguarded: ServerProcess,
                                                 check: Callable[[ServerProcess], None]) -> None:
    with pytest.raises(AssertionError):
        check(unguarded)


# ---- audit records of /tokenize and /detokenize --------------------------------------------


def test_tokenize_and_detokenize_are_audited_with_counts_not_content(server: ServerProcess) -> None:
    tokenized = post(server, "/tokenize", {"prompt": "w10 w11 w12"})
    detokenized = post(server, "/detokenize", {"tokens": [10, 11]})
    refused = post(server, "/tokenize", {"prompt": "w10"}, {"Authorization": "Bearer wrong"})
    expected = {tokenized: ("/tokenize", "finished", 3, "alice"), detokenized: ("/detokenize", "finished", 2, "alice"),
                refused: ("/tokenize", "rejected", None, None)}
    for response, (endpoint, outcome, count, tenant) in expected.items():
        record = server.audit_for(response.headers["x-request-id"])
        assert (record["endpoint"], record["outcome"], record.get("prompt_tokens"), record["tenant"]) == (
            endpoint, outcome, count, tenant), record
    text = server.audit_path.read_text()
    assert "w10 w11" not in text and "[10, 11]" not in text and "[10,11]" not in text


# ---- static bounds, in-process: at the limit parses, one past it is a 400 naming the field --


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "w5"}]} | fields


def _tool(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f"} | function}


def _call(**function: Any) -> dict[str, Any]:
    return {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"} | function}


def _assistant_calls(arguments: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [_call(arguments=arguments)]}


def nested_arguments(depth: int) -> str:
    """Arguments nested `depth` deep: far past the limit, stdlib json's parser would recurse past
    Python's recursion limit (a RecursionError, once a 500)."""
    return "[" * depth + "]" * depth


# (model, param, body at the limit, body one past it)
BOUNDS: list[tuple[Any, str, Callable[[int], dict[str, Any]], int]] = [
    (CompletionRequest, "model", lambda n: {"prompt": "w5", "model": "m" * n}, MAX_NAME_CHARS),
    (CompletionRequest, "stop", lambda n: {"prompt": "w5", "stop": "s" * n}, MAX_STOP_CHARS),
    (CompletionRequest, "stop", lambda n: {"prompt": "w5", "stop": ["s" * n]}, MAX_STOP_CHARS),
    (CompletionRequest, "logit_bias", lambda n: {"prompt": "w5", "logit_bias": {"1" * n: 1.0}}, MAX_TOKEN_ID_DIGITS),
    (CompletionRequest, "max_tokens", lambda n: {"prompt": "w5", "max_tokens": n}, INT32_MAX),
    (ChatCompletionRequest, "messages", lambda n: {"messages": [{"role": "user", "content": "w"}] * n},
     MAX_MESSAGES),
    (ChatCompletionRequest, "messages",
     lambda n: {"messages": [{"role": "user", "content": [{"type": "text", "text": "w"}] * n}]}, MAX_CONTENT_PARTS),
    (ChatCompletionRequest, "messages",
     lambda n: {"messages": [{"role": "assistant", "content": None, "tool_calls": [_call()] * n}]}, MAX_TOOLS),
    (ChatCompletionRequest, "messages",
     lambda n: {"messages": [{"role": "assistant", "content": None, "tool_calls": [_call(name="f" * n)]}]},
     MAX_FUNCTION_NAME_CHARS),
    (ChatCompletionRequest, "messages",
     lambda n: {"messages": [{"role": "tool", "content": "w", "tool_call_id": "i" * n}]}, MAX_NAME_CHARS),
    (ChatCompletionRequest, "messages", lambda n: {"messages": [{"role": "user", "content": "w", "name": "n" * n}]},
     MAX_FUNCTION_NAME_CHARS),
    (ChatCompletionRequest, "tools", lambda n: _chat(tools=[_tool(description="d" * n)]), MAX_DESCRIPTION_CHARS),
    (ChatCompletionRequest, "tool_choice",
     lambda n: _chat(tool_choice={"type": "function", "function": {"name": "f" * n}}), MAX_FUNCTION_NAME_CHARS),
    (ChatCompletionRequest, "response_format", lambda n: _chat(response_format={
        "type": "json_schema", "json_schema": {"name": "s", "description": "d" * n}}), MAX_DESCRIPTION_CHARS),
    (ChatCompletionRequest, "max_completion_tokens", lambda n: _chat(max_completion_tokens=n), INT32_MAX),
    (TokenizeChatBody, "messages", lambda n: {"messages": [{"role": "user", "content": "w"}] * n}, MAX_MESSAGES),
    (ChatCompletionRequest, "messages", lambda n: _chat(messages=[_assistant_calls(nested_arguments(n))]),
     MAX_ARGUMENTS_DEPTH),
    (TokenizeChatBody, "messages", lambda n: {"messages": [_assistant_calls(nested_arguments(n))]},
     MAX_ARGUMENTS_DEPTH),
    (DetokenizeBody, "model", lambda n: {"tokens": [1], "model": "m" * n}, MAX_NAME_CHARS),
]


@pytest.mark.parametrize(("model", "param", "body", "limit"), BOUNDS,
                         ids=[f"{m.__name__}-{p}-{limit}-{i}" for i, (m, p, _, limit) in enumerate(BOUNDS)])
def test_each_field_bound_refuses_one_past_its_limit(model: Any, param: str, body: Callable[[int], dict[str, Any]],
                                                     limit: int) -> None:
    parse_body(model, json.dumps(body(limit)).encode())  # the limit itself is accepted
    with pytest.raises(ApiError) as info:
        parse_body(model, json.dumps(body(limit + 1)).encode())
    err = info.value
    assert (err.status, err.code, err.param) == (400, "invalid_parameter", param), err
    assert str(limit) in err.message, err.message


@pytest.mark.parametrize("model", [ChatCompletionRequest, TokenizeChatBody])
def test_arguments_nested_past_the_parsers_recursion_limit_are_a_400(model: Any) -> None:
    body = {"messages": [{"role": "user", "content": "w5"}, _assistant_calls(nested_arguments(960))], "max_tokens": 3}
    if model is TokenizeChatBody:
        del body["max_tokens"]
    with pytest.raises(ApiError) as info:
        parse_body(model, json.dumps(body).encode())
    err = info.value
    assert (err.status, err.code, err.param) == (400, "invalid_parameter", "messages"), err
    assert str(MAX_ARGUMENTS_DEPTH) in err.message and "recursion" not in err.message, err.message


def test_a_bound_is_a_400_in_the_openai_shape_over_http(server: ServerProcess) -> None:
    response = post(server, "/v1/completions", {"prompt": "w5", "stop": ["s" * (MAX_STOP_CHARS + 1)]})
    err = error_of(response, 400)
    assert err["param"] == "stop" and str(MAX_STOP_CHARS) in err["message"]
    assert server.audit_for(response.headers["x-request-id"])["reason"] == "invalid_parameter"
