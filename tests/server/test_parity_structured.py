"""Structured output over HTTP and in the engine loop, on a character-level tiny model.

The official client's `chat.completions.parse(response_format=PydanticModel)` returns a parsed
object; an invalid schema is a 400 naming the problem; the engine loop compiles grammars off
the loop (a request waiting for its grammar can still be aborted, and never reaches the engine).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

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
