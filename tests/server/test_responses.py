"""`POST /v1/responses` (OpenAI's Responses API) on real servers, through the `openai` client.

A Responses request is a chat completion in another shape, so the strongest check is parity:
greedy, the same conversation gives the same text and the same token counts on both
endpoints, streamed or not. Tools (hermes, a named tool_choice forcing the call on random
weights) and `text.format` use the character-level model. Nothing is stored: `store` is taken,
`previous_response_id` and `GET /v1/responses/{id}` are 404.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from audit_outage import DEV_FULL, linked_audit_log, point
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_process import KEYS, ServerProcess, client_for

from kvseal.admission import AdmissionLimits
from kvseal.errors import InvalidParameter, RequestRejected
from kvseal.messages.msgs import RequestOutputMsg
from kvseal.server.body import parse_body
from kvseal.server.bounds import check_message_extras
from kvseal.server.chat import ChatFormatter
from kvseal.server.endpoint import ResponseIds
from kvseal.server.errors import ApiError
from kvseal.server.responses import ResponsesFormatter
from kvseal.server.responses_body import ResponsesBody, ResponsesRequest
from kvseal.server.tools import HermesToolParser
from kvseal.server.transcript import Transcript

ALICE = {"Authorization": "Bearer key-alice"}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function", "name": "get_time", "description": "time", "parameters": TIME}]
CHAT_TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_time", "description": "time",
                                                           "parameters": TIME}}]
OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}


def _chat(client: openai.OpenAI, server: ServerProcess, messages: list[Any], max_tokens: int, **extra: Any) -> Any:
    return client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=max_tokens,
                                          temperature=0, **extra)


def _post(server: ServerProcess, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{server.base_url}/responses", json=body, headers=ALICE if headers is None else headers,
                      timeout=60)


def _events(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's events, each checked to come as `event: <type>` then its `data:`; no `[DONE]`."""
    with httpx.stream("POST", f"{server.base_url}/responses", json=body | {"stream": True}, headers=ALICE,
                      timeout=60) as response:
        assert response.status_code == 200
        text = response.read().decode()
    assert "[DONE]" not in text
    events = []
    for block in text.strip().split("\n\n"):
        event_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_text_and_usage_are_chats(server: ServerProcess, alice: openai.OpenAI) -> None:
    """`instructions` is the system message; greedy, the text and the token counts are chat's,
    and an output cut by max_output_tokens is incomplete."""
    out = alice.responses.create(model=server.model_name, instructions="w1 w2", input="w3 w4 w5",
                                 max_output_tokens=6, temperature=0)
    chat = _chat(alice, server, [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3 w4 w5"}], 6)
    assert out.output_text == chat.choices[0].message.content
    assert out.id.startswith("resp_") and out.object == "response" and out.model == server.model_name
    assert out.usage is not None and chat.usage is not None
    assert (out.usage.input_tokens, out.usage.output_tokens, out.usage.total_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert out.usage.output_tokens_details.reasoning_tokens == 0
    [message] = out.output
    assert message.type == "message" and message.role == "assistant"
    if chat.choices[0].finish_reason == "length":
        assert out.status == "incomplete" and out.incomplete_details is not None
        assert out.incomplete_details.reason == "max_output_tokens"
    else:
        assert out.status == "completed" and out.incomplete_details is None
    assert out.instructions == "w1 w2" and out.max_output_tokens == 6 and out.temperature == 0


def test_a_response_cut_by_its_length_is_incomplete(server: ServerProcess, alice: openai.OpenAI) -> None:
    out = alice.responses.create(model=server.model_name, input="w7 w8", max_output_tokens=1, temperature=0)
    chat = _chat(alice, server, [{"role": "user", "content": "w7 w8"}], 1)
    assert chat.choices[0].finish_reason == "length"  # one token is never the end-of-sequence on this model
    assert out.status == "incomplete" and out.incomplete_details is not None
    assert out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].status == "incomplete" and out.usage is not None and out.usage.output_tokens == 1


def test_input_items_are_chats_messages(server: ServerProcess, alice: openai.OpenAI) -> None:
    """Messages as items: a developer message, input_text parts (joined as chat joins text
    parts), an earlier answer sent back as output_text."""
    items: list[Any] = [
        {"role": "developer", "content": "w9"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "w1"},
                                                        {"type": "input_text", "text": "w2"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "w3", "annotations": []}]},
        {"role": "user", "content": "w4"},
    ]
    out = alice.responses.create(model=server.model_name, input=items, max_output_tokens=5, temperature=0)
    chat = _chat(alice, server, [{"role": "system", "content": "w9"}, {"role": "user", "content": "w1\nw2"},
                                 {"role": "assistant", "content": "w3"}, {"role": "user", "content": "w4"}], 5)
    assert out.output_text == chat.choices[0].message.content
    assert out.usage is not None and chat.usage is not None
    assert out.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_deltas_add_up_to_the_unstreamed_response(server: ServerProcess, alice: openai.OpenAI) -> None:
    body = {"model": server.model_name, "input": "w5 w6", "max_output_tokens": 7, "temperature": 0,
            "metadata": {"k": "v"}, "user": "u1"}
    whole = _post(server, body).json()
    events = _events(server, body)
    kinds = [e["type"] for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]  # as vLLM ends every stream, the status in its response
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole["output"][0]["content"][0]["text"]
    assert next(e for e in events if e["type"] == "response.output_text.done")["text"] == text
    last = events[-1]["response"]
    assert last["status"] == whole["status"] and last["incomplete_details"] == whole["incomplete_details"]
    uncached = {k: v for k, v in last["usage"].items() if k != "input_tokens_details"}  # (the second one hits)
    assert uncached == {k: v for k, v in whole["usage"].items() if k != "input_tokens_details"}
    assert last["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert last["output"][0]["content"] == whole["output"][0]["content"]
    assert last["id"] == events[0]["response"]["id"] and last["metadata"] == {"k": "v"} and last["user"] == "u1"
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []


def test_the_openai_client_reads_the_stream(server: ServerProcess, alice: openai.OpenAI) -> None:
    with alice.responses.stream(model=server.model_name, input="w5 w6", max_output_tokens=4,
                                temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and final.status == "incomplete"
    assert final.output_text == alice.responses.create(model=server.model_name, input="w5 w6", max_output_tokens=4,
                                                       temperature=0).output_text


def test_a_forced_function_call_and_its_result(char_server: ServerProcess) -> None:
    """A named tool_choice forces the call (random weights, the grammar): a function_call item;
    the next turn sends it back with its function_call_output, and reads as chat's history."""
    client = client_for(char_server, "key-alice")
    out = client.responses.create(model=char_server.model_name, input="time?", tools=TOOLS, max_output_tokens=100,
                                  temperature=0, tool_choice={"type": "function", "name": "get_time"})
    [call] = [item for item in out.output if item.type == "function_call"]
    assert call.name == "get_time" and call.call_id and call.id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), TIME)
    assert out.tools[0].type == "function" and out.tool_choice.type == "function"  # type: ignore[union-attr]
    history: list[Any] = [{"role": "user", "content": "time?"}, call.model_dump(exclude_none=True),
                          {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}]
    follow = client.responses.create(model=char_server.model_name, input=history, tools=TOOLS, tool_choice="none",
                                     max_output_tokens=4, temperature=0)
    chat = _chat(client, char_server, [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "get_time", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"}], 4, tools=CHAT_TOOLS, tool_choice="none")
    assert follow.output_text == chat.choices[0].message.content
    assert follow.usage is not None and chat.usage is not None
    assert follow.usage.input_tokens == chat.usage.prompt_tokens


def test_a_streamed_call_adds_up_to_its_item(char_server: ServerProcess) -> None:
    body = {"model": char_server.model_name, "input": "time?", "tools": TOOLS, "max_output_tokens": 100,
            "temperature": 0, "tool_choice": "required", "parallel_tool_calls": False}  # one call, then the end
    events = _events(char_server, body)
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["item"]["type"] for e in added] == ["function_call"]
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == arguments and done["item_id"] == added[0]["item"]["id"]
    [item] = events[-1]["response"]["output"]
    assert (item["type"], item["name"], item["arguments"], item["status"]) == \
        ("function_call", "get_time", arguments, "completed")
    jsonschema.validate(json.loads(arguments), TIME)
    assert events[-1]["response"]["parallel_tool_calls"] is False


def test_text_format_json_schema_gives_schema_valid_json(char_server: ServerProcess) -> None:
    client = client_for(char_server, "key-alice")
    out = client.responses.create(model=char_server.model_name, input="ok?", max_output_tokens=60, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "answer", "schema": OK_SCHEMA}})
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), OK_SCHEMA)
    assert out.text is not None and out.text.format is not None and out.text.format.type == "json_schema"


def test_keys_and_models_are_checked_and_refusals_audited(server: ServerProcess) -> None:
    body = {"model": server.model_name, "input": "w1", "max_output_tokens": 2}
    assert _post(server, body, headers={}).status_code == 401
    assert _post(server, body, headers={"Authorization": "Bearer nope"}).status_code == 401
    missing = _post(server, body | {"model": "other"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    record = server.audit_for(missing.headers["x-request-id"])
    assert record["endpoint"] == "/v1/responses" and record["outcome"] != "completed"
    served = _post(server, body)
    assert served.status_code == 200
    assert server.audit_for(served.headers["x-request-id"])["tenant"] == "alice"
    assert served.headers["x-request-id"] == served.json()["id"]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input"),
    ({"input": "w1", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "w1", "tools": [{"type": "function", "name": f"f{i}"} for i in range(200)]}, "tools"),
    ({"input": "w1", "messages": []}, "messages"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]}, "input"),
    ({"input": "w1", "background": True}, "background"),
    ({"input": "w1", "reasoning": {"summary": "auto"}}, "reasoning"),
    ({"input": "w1", "tool_choice": "required"}, "tool_choice"),
    ({"input": "w1", "truncation": "auto"}, "truncation"),
    ({"input": "w1", "max_output_tokens": 100_000}, "context_length_exceeded"),
    ({"input": "w1 " * 5000}, "context_length_exceeded"),
])
def test_bad_requests_are_400_in_openais_shape(server: ServerProcess, body: dict[str, Any], param: str) -> None:
    """`param`: the field the error names, or the code of an error about the whole request."""
    response = _post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert param in (error["param"], error["code"]), error
    assert server.audit_for(response.headers["x-request-id"])["outcome"] != "completed"


def test_a_tenants_token_cap_names_max_output_tokens(server: ServerProcess) -> None:
    capped = {"Authorization": "Bearer key-capped"}  # max_tokens 32
    refused = _post(server, {"input": "w1", "max_output_tokens": 33}, capped)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_output_tokens"
    served = _post(server, {"input": "w1"}, capped)
    assert served.status_code == 200 and served.json()["usage"]["output_tokens"] <= 32


def test_nothing_is_stored(server: ServerProcess) -> None:
    stored = _post(server, {"input": "w1", "max_output_tokens": 2, "store": True})
    assert stored.status_code == 200 and stored.json()["store"] is False
    response_id = stored.json()["id"]
    chained = _post(server, {"input": "w2", "max_output_tokens": 2, "previous_response_id": response_id})
    assert chained.status_code == 404
    assert chained.json()["error"]["code"] == "response_not_found"
    assert chained.json()["error"]["param"] == "previous_response_id"
    got = httpx.get(f"{server.base_url}/responses/{response_id}", headers=ALICE, timeout=60)
    assert got.status_code == 404 and got.json()["error"]["code"] == "response_not_found"
    assert httpx.get(f"{server.base_url}/responses/{response_id}", timeout=60).status_code == 401
    cancelled = httpx.post(f"{server.base_url}/responses/{response_id}/cancel", headers=ALICE, timeout=60)
    assert cancelled.status_code == 404 and cancelled.json()["error"]["code"] == "response_not_found"
    client = client_for(server, "key-alice")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response_id)


def _cached(server: ServerProcess, headers: dict[str, str], instructions: str) -> int:
    response = _post(server, {"instructions": instructions, "input": "w1", "max_output_tokens": 2,
                              "temperature": 0}, headers)
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["input_tokens_details"]["cached_tokens"])


def test_a_tenants_cached_prefix_is_its_own(server: ServerProcess) -> None:
    """I5 through /v1/responses: alice's second request hits her cached prefix; bob's identical
    request finds nothing cached."""
    instructions = " ".join(f"w{i}" for i in range(500, 540))
    assert _cached(server, ALICE, instructions) == 0
    assert _cached(server, ALICE, instructions) > 0
    assert _cached(server, {"Authorization": "Bearer key-bob"}, instructions) == 0
    salted = {"instructions": instructions, "input": "w1", "max_output_tokens": 2, "cache_salt": "s1"}
    assert _post(server, salted).json()["usage"]["input_tokens_details"]["cached_tokens"] == 0  # vLLM's salt


def test_truncation_is_disabled_only(server: ServerProcess) -> None:
    assert _post(server, {"input": "w1", "max_output_tokens": 2, "truncation": "disabled"}).status_code == 200
    refused = _post(server, {"input": "w1 " * 600, "truncation": "auto"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncation"


def test_an_input_of_reasoning_items_alone_is_refused_naming_input(server: ServerProcess) -> None:
    """Not chat's `messages`, a field this client never sent."""
    refused = _post(server, {"input": [{"type": "reasoning", "summary": []}], "max_output_tokens": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input", refused.text
    assert "reasoning items" in refused.json()["error"]["message"]


def _success_total(server: ServerProcess) -> float:
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", server.metrics_text(),
                                            re.MULTILINE))


def test_responses_are_counted_and_listed(server: ServerProcess) -> None:
    before = _success_total(server)
    assert _post(server, {"input": "w1", "max_output_tokens": 2}).status_code == 200
    assert _success_total(server) == before + 1
    spec = httpx.get(f"{server.url}/openapi.json", headers=ALICE, timeout=60).json()
    assert "/v1/responses" in spec["paths"]
    assert "input" in spec["components"]["schemas"]["ResponsesRequest"]["properties"]


def test_a_stream_the_client_leaves_is_aborted(server: ServerProcess) -> None:
    body = {"input": "w5 w6 w7", "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/responses", json=body, timeout=60, headers=ALICE) as response:
        request_id = response.headers["x-request-id"]
        next(response.iter_lines())  # generating now
    record = server.audit_for(request_id)
    assert record["outcome"] == "aborted" and record["reason"] == "client_disconnected"


def test_a_conversation_of_items_reads_as_chats() -> None:
    """The conversion itself: calls of one turn in one assistant message, reasoning on the turn
    after it, a result as a tool message."""
    body = ResponsesBody.model_validate_json(json.dumps({"instructions": "be brief", "input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
    ], "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"}, "max_output_tokens": 9}))
    messages = [m.as_template_input() for m in body.messages]
    assert messages == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "reasoning": "hm", "reasoning_content": "hm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}, {"role": "tool", "tool_call_id": "c2", "content": "2"},
    ]
    assert body.tools is not None and body.tools[0].function.name == "get_time"
    effort = ResponsesBody.model_validate_json(json.dumps({"input": "q", "reasoning": {"effort": "low"}}))
    assert effort.chat_template_kwargs == {"reasoning_effort": "low"}  # as vLLM passes it to the template
    assert body.tool_choice is not None and body.max_completion_tokens == 9


def test_reasoning_is_an_item_as_chat_splits_it(reasoning_server: ServerProcess) -> None:
    """With a reasoning parser, the reasoning chat splits off is a `reasoning` item, streamed as
    reasoning_text deltas, its tokens counted. The prompt leaves a `<think>` open (the
    character-level template ends with the user's `<think>`), so the output begins inside it."""
    client = client_for(reasoning_server, "key-alice")
    out = client.responses.create(model=reasoning_server.model_name, input="<think>", max_output_tokens=12,
                                  temperature=0)
    chat = _chat(client, reasoning_server, [{"role": "user", "content": "<think>"}], 12)
    reasoning = (chat.choices[0].message.model_extra or {}).get("reasoning")
    assert reasoning
    [item] = [i for i in out.output if i.type == "reasoning"]
    assert item.content is not None and item.content[0].text == reasoning
    assert out.output_text == (chat.choices[0].message.content or "")
    assert out.usage is not None and 0 < out.usage.output_tokens_details.reasoning_tokens <= out.usage.output_tokens
    events = _events(reasoning_server, {"model": reasoning_server.model_name, "input": "<think>",
                                        "max_output_tokens": 12, "temperature": 0})
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == reasoning
    assert events[-1]["response"]["usage"]["output_tokens_details"] == \
        {"reasoning_tokens": out.usage.output_tokens_details.reasoning_tokens}


_texts = st.text(max_size=12)
_parts = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "refusal", "input_image", "x"]),
                                "text": _texts})
_items = st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "item_reference"])},
    optional={"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
              "content": _texts | st.lists(_parts, max_size=3), "call_id": _texts, "name": _texts,
              "arguments": st.sampled_from(["{}", "{\"a\": 1}", "[", "3"]), "output": _texts,
              "summary": st.just([]), "id": _texts})
_fields = {"input": _texts | st.lists(_items, max_size=4), "instructions": _texts,
           "max_output_tokens": st.integers(-1, 3), "temperature": st.floats(-1, 3, allow_nan=False),
           "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]),
                                                    "name": st.sampled_from(["f", "g", "bad name"])}), max_size=2),
           "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}, "x"]),
           "text": st.sampled_from([{"format": {"type": "json_object"}}, {"format": {"type": "text"}},
                                    {"format": {"type": "json_schema"}}]),
           "store": st.booleans(), "stream": st.booleans(), "truncation": st.sampled_from(["auto", "x"]),
           "previous_response_id": _texts, "reasoning": st.sampled_from([{}, {"effort": "low"}, {"effort": 3}])}


@given(body=st.fixed_dictionaries({}, optional=_fields))
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_arbitrary_responses_bodies_get_an_answer_below_500(server: ServerProcess, body: dict[str, Any]) -> None:
    response = httpx.post(f"{server.base_url}/responses", content=json.dumps(body), timeout=30,
                          headers={"Authorization": "Bearer key-fuzz", "content-type": "application/json"})
    assert response.status_code < 500, response.text


def test_an_error_after_the_stream_began_is_its_last_event(server_model_dir: Path, tmp_path: Path) -> None:
    """The disk fills while a stream runs: its audit line cannot be written (I8), so it never
    finishes normally; its last event is one `error` (no response.completed, no [DONE])."""
    link, real = linked_audit_log(tmp_path)
    server = ServerProcess(server_model_dir, tmp_path, keys=KEYS).start()
    try:
        body = {"input": "w5 w6", "max_output_tokens": 3, "temperature": 0}
        assert _post(server, body).status_code == 200
        point(link, DEV_FULL)
        events = _events(server, body)
        assert events[0]["type"] == "response.created" and "response.completed" not in [e["type"] for e in events]
        assert events[-1] | {"message": ""} == {"type": "error", "sequence_number": len(events) - 1,
                                               "code": "audit_unavailable", "param": None, "message": ""}
        withheld = _post(server, body)
        assert withheld.status_code == 503 and withheld.json()["error"]["code"] == "audit_unavailable"
        point(link, real)
    finally:
        assert server.terminate() == 0



# ---- the stream's items against the unstreamed answer, token splits a tiny model cannot make ----

def _hermes_formatter() -> ResponsesFormatter:
    ids = ResponseIds("resp_x", "m", 0)
    chat = ChatFormatter(ids, False, False, None, 1, HermesToolParser())
    return ResponsesFormatter(chat, ResponsesRequest.model_validate({"input": "hi"}), ids)


def _streamed_and_unstreamed(pieces: list[str], finish_reason: str) -> tuple[list[dict[str, Any]],
                                                                             list[dict[str, Any]]]:
    outs = [RequestOutputMsg("r", "t", [i], piece, i == len(pieces) - 1,
                             finish_reason if i == len(pieces) - 1 else None, None, 3, i + 1, 1)
            for i, piece in enumerate(pieces)]
    streaming = _hermes_formatter()
    events = [e for out in outs for e in streaming.delta_chunks(0, out)]
    transcript = Transcript()
    for out in outs:
        transcript.add(out)
    return events, _hermes_formatter().response([transcript])["output"]


def test_a_calls_last_arguments_arriving_with_the_text_after_its_block_are_streamed() -> None:
    """The step that closes `</tool_call>` carries both the call's last `}` and the text after the
    block: the call's arguments are whole in its events and in response.completed, as unstreamed."""
    events, unstreamed = _streamed_and_unstreamed(
        ['<tool_call>{"name": "f", "arguments": {"a": 1}}', "</tool_call>Done", "."], "stop")
    [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == '{"a": 1}'
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == '{"a": 1}'
    streamed = events[-1]["response"]["output"]
    calls = [(i["name"], i["arguments"], i["status"]) for i in streamed if i["type"] == "function_call"]
    assert calls == [(i["name"], i["arguments"], "completed") for i in unstreamed if i["type"] == "function_call"]


def test_a_call_cut_by_max_output_tokens_is_never_a_completed_function_call() -> None:
    """A draft the length cut leaves unread was sent as a call item (it cannot be taken back), but
    it ends `incomplete`, its arguments no JSON object: no agent runs it. Unstreamed it is text."""
    events, unstreamed = _streamed_and_unstreamed(
        ['<tool_call>{"name": "f", "arguments": {"a": ', '"x', 'yz'], "length")
    streamed = events[-1]["response"]["output"]
    calls = [i for i in streamed if i["type"] == "function_call"]
    assert calls and all(i["status"] == "incomplete" for i in calls), streamed
    assert [i["type"] for i in unstreamed] == ["message"] and events[-1]["response"]["status"] == "incomplete"


def _refused(body: dict[str, Any]) -> tuple[str | None, str]:
    """The param and message a Responses body is refused with, whichever check refuses it."""
    try:
        parse_body(ResponsesBody, json.dumps(body).encode())
    except ApiError as err:
        return err.param, err.message
    except RequestRejected as exc:
        return exc.param, exc.message
    raise AssertionError("the body was taken")


def _call(index: int) -> dict[str, Any]:
    return {"type": "function_call", "call_id": f"c{index}", "name": "f", "arguments": "{}"}


def test_instructions_past_the_message_limit_are_refused_naming_input() -> None:
    """Each item is within its bound; instructions are one message more than 2,048 items."""
    assert _refused({"instructions": "be brief", "input": [{"role": "user", "content": "x"}] * 2048}) == (
        "input", "Invalid value for 'input': its items and instructions make 2049 messages (instructions one, each "
                 "message or function_call_output item one, consecutive function_call items one); a request may "
                 "have at most 2048. Send fewer input items.")
    ResponsesBody.model_validate_json(json.dumps({"input": [{"role": "user", "content": "x"}] * 2048}))


@pytest.mark.parametrize(("items", "begins_at"), [
    ([_call(i) for i in range(129)], 0),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, *[_call(i) for i in range(129)]], 1),
    ([*[_call(i) for i in range(64)], {"type": "reasoning", "summary": []}, *[_call(i) for i in range(65)]], 0),
])
def test_one_turns_calls_past_the_limit_are_refused_naming_input(items: list[Any], begins_at: int) -> None:
    """Consecutive function_call items (a reasoning item between them does not end the turn, an
    assistant message item before them begins it) are one assistant turn's calls: at most 128."""
    assert _refused({"input": [*items, {"role": "user", "content": "x"}]}) == (
        "input", f"Invalid value for 'input': the assistant turn that begins at input.{begins_at} has 129 "
                 f"function_call items (consecutive function_call items, and an assistant message item before "
                 f"them, are one turn); a turn may have at most 128 calls. Send fewer calls in a row.")
    ResponsesBody.model_validate_json(json.dumps({"input": items[:-1]}))  # one call fewer is taken


def test_the_calls_arguments_past_what_a_prompt_holds_are_refused_naming_input() -> None:
    body = ResponsesBody.model_validate_json(json.dumps({"input": [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": json.dumps({"a": "x" * 100})}]}))
    limits = AdmissionLimits(max_model_len=16, kv_cache_tokens=64, vocab_size=512)
    with pytest.raises(InvalidParameter) as refused:
        check_message_extras(body.messages, limits, max_token_chars=4, names=body.conversation_names)
    assert refused.value.param == "input"
    assert refused.value.message.startswith("the function_call items' arguments have 108 characters")
