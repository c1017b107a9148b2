"""Structured output over HTTP and in the engine loop, on a character-level tiny model.

The official client's `chat.completions.parse(response_format=PydanticModel)` returns a parsed
object; an invalid schema is a 400 naming the problem; the engine loop compiles grammars off
the loop (a request waiting for its grammar can still be aborted, and never reaches the engine).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel
from server_process import ServerProcess, client_for
from test_engine_loop import Harness, add

from kvseal.config import EngineArgs
from kvseal.engine.engine import LLMEngine
from kvseal.messages.msgs import AbortMsg, OutputsMsg
from kvseal.types import StructuredOutput


class Verdict(BaseModel):
    ok: bool
    colour: Literal["red", "green", "blue"]


def test_parse_returns_a_parsed_object(char_server: ServerProcess) -> None:
    client = client_for(char_server, "key-alice")
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=char_server.model_name, messages=[{"role": "user", "content": "judge"}], response_format=Verdict,
            max_tokens=60, temperature=1.0, seed=seed)
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Verdict) and completion.choices[0].finish_reason == "stop"


def test_json_schema_on_completions_and_with_n(char_server: ServerProcess) -> None:
    schema = Verdict.model_json_schema()
    out = client_for(char_server, "key-bob").completions.create(
        model=char_server.model_name, prompt="x", max_tokens=60, temperature=1.2, seed=5, n=3,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}})
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.text), schema)


def test_json_object_stream(char_server: ServerProcess) -> None:
    client = client_for(char_server, "key-alice")
    chunks = client.chat.completions.create(
        model=char_server.model_name, messages=[{"role": "user", "content": "j"}], max_tokens=300,
        temperature=0, response_format={"type": "json_object"}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("{")


@pytest.mark.parametrize(("response_format", "problem"), [
    ({"type": "json_schema", "json_schema": {"name": "v", "schema": {"type": "objectx"}}}, "objectx"),
    ({"type": "json_schema", "json_schema": {"name": "v", "schema": {"type": "object", "properties": 5}}},
     "properties"),
    ({"type": "json_schema", "json_schema": {"name": "v"}}, "schema"),
    ({"type": "xml"}, "response_format"),
])
def test_invalid_response_format_is_400_naming_the_problem(char_server: ServerProcess, response_format: dict,
                                                           problem: str) -> None:
    response = httpx.post(f"{char_server.base_url}/chat/completions", timeout=30,
                          headers={"Authorization": "Bearer key-alice"},
                          json={"messages": [{"role": "user", "content": "j"}], "response_format": response_format})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format" and problem in error["message"]


BOOLEAN_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "boolean"}}}
ENUM_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["a"]}}}
CALL_F = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}}}]
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60, headers={"Authorization": "Bearer key-alice"})


def _stream_events(server: ServerProcess, path: str, body: dict) -> tuple[httpx.Response, list[dict]]:
    """The response and its `data:` events before `[DONE]`, which must end the stream."""
    with httpx.stream("POST", f"{server.base_url}{path}", json=body | {"stream": True}, timeout=60,
                      headers={"Authorization": "Bearer key-alice"}) as response:
        data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data
    return response, [json.loads(d) for d in data[:-1]]


# ---- vLLM's structured outputs: guided_* and structured_outputs ----------------------------------

CHOICES = ["red", "green", 'blue "sky"']
REGEX = r"[0-9]{2}:[0-9]{2}"
GRAMMAR = 'root ::= "<" [a-z] [a-z]? ">"'


@pytest.mark.parametrize(("path", "fields", "check"), [
    ("/completions", {"guided_choice": CHOICES}, lambda text: text in CHOICES),
    ("/chat/completions", {"guided_regex": REGEX}, lambda text: re.fullmatch(REGEX, text)),
    ("/completions", {"guided_grammar": GRAMMAR}, lambda text: re.fullmatch(r"<[a-z]{1,2}>", text)),
    ("/chat/completions", {"guided_json": Verdict.model_json_schema()},
     lambda text: Verdict.model_validate_json(text)),
    ("/completions", {"structured_outputs": {"choice": CHOICES}}, lambda text: text in CHOICES),
    ("/chat/completions", {"structured_outputs": {"regex": REGEX}}, lambda text: re.fullmatch(REGEX, text)),
    ("/completions", {"structured_outputs": {"json": json.dumps(Verdict.model_json_schema())}},
     lambda text: Verdict.model_validate_json(text)),
    ("/chat/completions", {"structured_outputs": {"json_object": True}}, lambda text: isinstance(json.loads(text),
                                                                                                dict)),
])
def test_vllms_structured_outputs_are_enforced(char_server: ServerProcess, path: str, fields: dict,
                                               check: Any) -> None:
    """Each of vLLM's ways of asking, on the endpoint its users send it to, n=3 sampled choices,
    and streamed; the audit record names the field, never its content."""
    prompt = {"prompt": "q"} if path == "/completions" else CHAT
    body = prompt | fields | {"max_tokens": 80, "temperature": 1.0, "seed": 11, "n": 3}
    response = _post(char_server, path, body)
    assert response.status_code == 200, response.text
    texts = [c["text"] if "text" in c else c["message"]["content"] for c in response.json()["choices"]]
    assert all(check(text) for text in texts), texts
    assert char_server.audit_for(response.headers["x-request-id"])["features"] == ["n", "seed", *fields]
    _, events = _stream_events(char_server, path, body)
    streamed = ["", "", ""]
    for event in events:
        for c in event["choices"]:
            streamed[c["index"]] += c.get("text") or c.get("delta", {}).get("content") or ""
    assert streamed == texts, "seeded: the stream gives the same answers"


@pytest.mark.parametrize(("fields", "param", "problem"), [
    ({"guided_regex": "([a-"}, "guided_regex", "Unclosed"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "missing"),
    ({"guided_json": {"type": "objectx"}}, "guided_json", "objectx"),
    ({"guided_choice": []}, "guided_choice", "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "2 ways"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "2 ways"),
    ({"guided_regex": "a", "tools": CALL_F, "tool_choice": "required"}, "guided_regex", "tool_choice"),
])
def test_a_bad_or_second_structured_output_spec_is_400_naming_it(char_server: ServerProcess, fields: dict,
                                                                 param: str, problem: str) -> None:
    response = _post(char_server, "/chat/completions", CHAT | fields | {"max_tokens": 8})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and problem in error["message"], error


@pytest.mark.parametrize(("path", "body", "answer"), [
    ("/chat/completions", CHAT | {"response_format": BOOLEAN_FORMAT, "min_tokens": 20}, "false"),
    ("/chat/completions", CHAT | {"response_format": {"type": "json_object"}, "min_tokens": 20}, "{}"),
    ("/completions", {"prompt": "x", "response_format": ENUM_FORMAT, "min_tokens": 5, "n": 2}, '"a"'),
])
def test_min_tokens_with_a_grammar_ends_with_the_complete_answer(char_server: ServerProcess, path: str, body: dict,
                                                                 answer: str) -> None:
    """The grammar wins over min_tokens: once the answer is complete the request stops (200,
    finish_reason stop, audited as finished), streamed or not; never a 500 or an error event."""
    body = body | {"temperature": 0, "max_tokens": 30}
    response = _post(char_server, path, body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == body.get("n", 1)
    for choice in choices:
        text = choice["message"]["content"] if "messages" in body else choice["text"]
        assert (text, choice["finish_reason"]) == (answer, "stop")
    assert response.json()["usage"]["completion_tokens"] < body["min_tokens"] * len(choices), "the case under test"
    assert char_server.audit_for(response.headers["x-request-id"])["outcome"] == "finished"
    streamed, events = _stream_events(char_server, path, body)
    assert streamed.status_code == 200 and not [e for e in events if "error" in e], events
    for index in range(len(choices)):
        mine = [c for e in events for c in e["choices"] if c["index"] == index]
        text = "".join((c["delta"].get("content") or "") if "messages" in body else c["text"] for c in mine)
        assert (text, mine[-1]["finish_reason"]) == (answer, "stop")


def test_min_tokens_with_a_required_tool_call_ends_with_the_call(char_server: ServerProcess) -> None:
    body = CHAT | {"tools": CALL_F, "tool_choice": "required", "min_tokens": 90, "temperature": 0, "max_tokens": 120,
                   "parallel_tool_calls": False}  # (one call: its grammar ends after it)
    response = _post(char_server, "/chat/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] < body["min_tokens"], "the case under test"
    choice = response.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "f" and isinstance(json.loads(call["function"]["arguments"])["a"], bool)
    assert choice["finish_reason"] == "tool_calls"
    streamed, events = _stream_events(char_server, "/chat/completions", body)
    assert streamed.status_code == 200 and not [e for e in events if "error" in e], events
    assert [d["function"]["name"] for e in events for c in e["choices"] for d in c["delta"].get("tool_calls") or []
            if d.get("function", {}).get("name")] == ["f"]


@pytest.fixture(scope="module")
def char_engine(char_dir: Path) -> Iterator[LLMEngine]:
    engine = LLMEngine(EngineArgs(model=str(char_dir), dtype="float32", kv_cache_tokens=256, page_size=4,
                                  max_model_len=128, grammar_compile_workers=1))
    yield engine
    engine.close()


def test_engine_loop_compiles_off_the_loop_and_can_abort_a_waiting_request(char_engine: LLMEngine) -> None:
    harness = Harness(char_engine)
    spec = StructuredOutput("json_schema", json.dumps(Verdict.model_json_schema()))
    try:
        harness.send(add("waiting", [40, 41], structured=spec, max_tokens=60))
        harness.send(AbortMsg("waiting", "alice", "client_disconnected"))
        aborted = [o for m in harness.run() if isinstance(m, OutputsMsg) for o in m.outputs]
        assert [(o.request_id, o.finish_reason, o.error) for o in aborted] == [
            ("waiting", "abort", "client_disconnected")]
        assert not char_engine.has_unfinished(), "a request aborted while compiling never reaches the engine"
        harness.send(add("served", [40, 41], structured=spec, max_tokens=60))
        outputs = harness.run_until_finished("served")
        jsonschema.validate(json.loads(char_engine.tokenizer.decode(
            [t for o in outputs for t in o.new_token_ids], skip_special_tokens=True)), Verdict.model_json_schema())
    finally:
        harness.close()
    char_engine.check_integrity()
