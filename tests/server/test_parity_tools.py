"""Tools and tool_choice on chat completions (`--tool-call-parser hermes`; `llama3_json`, `mistral`,
`pythonic` and `qwen3_coder` last).

The character-level tiny model's chat template renders the tools and past tool calls; a
named or required tool_choice is enforced with the grammar, so even random weights produce a
call whose arguments validate against the tool's parameters.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_process import KEYS, ServerProcess, client_for

from kvseal.errors import InvalidParameter
from kvseal.server.protocol import ChatCompletionRequest
from kvseal.server.tools import (
    CallDelta,
    CanonicalJson,
    FirstCallOnly,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
    ToolCallStream,
    call_schema,
    tool_setup,
)
from kvseal.structured.grammars import tool_call_grammar, tool_calls_grammar

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
           "required": ["city", "celsius"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES: list[Any] = [{"role": "user", "content": "weather?"}]


@pytest.fixture
def client(char_server: ServerProcess) -> openai.OpenAI:
    return client_for(char_server, "key-alice")


def _validate(call: Any) -> None:
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_named_tool_choice_yields_a_valid_call(char_server: ServerProcess, client: openai.OpenAI) -> None:
    for seed in range(3):
        out = client.chat.completions.create(
            model=char_server.model_name, messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=1.0,
            seed=seed, tool_choice={"type": "function", "function": {"name": "get_time"}})
        message = out.choices[0].message
        assert message.tool_calls is not None and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.function.name == "get_time" and call.id.startswith("call_") and call.type == "function"
        _validate(call)
        assert out.choices[0].finish_reason == "stop"


def test_required_tool_choice_calls_one_of_the_tools(char_server: ServerProcess, client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=char_server.model_name, messages=MESSAGES, tools=TOOLS, n=3,
                                         max_tokens=100, temperature=1.0, seed=1, tool_choice="required",
                                         parallel_tool_calls=False)  # (one call, which the test's weights end after)
    for choice in out.choices:
        assert choice.message.tool_calls is not None and choice.finish_reason == "tool_calls"
        _validate(choice.message.tool_calls[0])


def test_streamed_tool_call_deltas_accumulate_to_a_call(char_server: ServerProcess, client: openai.OpenAI) -> None:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(
            model=char_server.model_name, messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=0.5, seed=2,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.content or "<tool_call>" not in choice.delta.content
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or "" if delta.function else ""
                entry["arguments"] += delta.function.arguments or "" if delta.function else ""
            finish = choice.finish_reason or finish
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and finish == "stop"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


def _stream_calls(client: openai.OpenAI, **fields: Any) -> tuple[list[dict[str, Any]], list[Any], str | None]:
    """(each index's call as its deltas add up, with how many argument pieces it came in; every
    tool_calls delta in order; the finish reason) of a streamed answer."""
    calls: dict[int, dict[str, Any]] = {}
    deltas, finish = [], None
    for chunk in client.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                deltas.append(delta)
                assert delta.function is not None
                if delta.index not in calls:
                    assert delta.function.name and delta.id and delta.type == "function", "the name comes first"
                    calls[delta.index] = {"name": delta.function.name, "arguments": "", "pieces": 0}
                else:
                    assert delta.function.name is None and delta.id is None
                calls[delta.index]["arguments"] += delta.function.arguments or ""
                calls[delta.index]["pieces"] += bool(delta.function.arguments)
            finish = choice.finish_reason or finish
    assert list(calls) == list(range(len(calls)))
    return [calls[index] for index in range(len(calls))], deltas, finish


@pytest.mark.parametrize("tool_choice", ["auto", "required", "named"])
def test_a_streamed_call_comes_in_pieces_adding_up_to_the_unstreamed_one(
        char_server: ServerProcess, client: openai.OpenAI, tool_choice: str) -> None:
    """As vLLM streams a call: its index, id and name first, then its arguments in pieces as the
    model writes them, which add up to the unstreamed call's arguments (same seed, same text).
    auto: a call the model writes (held to the format by a regex); required and named: the
    enforced call."""
    fields: dict[str, Any] = {"model": char_server.model_name, "messages": MESSAGES, "tools": TOOLS,
                              "max_tokens": 200, "temperature": 1.0, "seed": 4}
    if tool_choice == "auto":
        written = ('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": true}}'
                   '\n</tool_call>')
        fields["extra_body"] = {"guided_regex": _regex_of(written)}
    else:
        fields["tool_choice"] = tool_choice if tool_choice == "required" else \
            {"type": "function", "function": {"name": "get_weather"}}
        fields["tools"] = TOOLS[:1]  # (required: one tool, so that the test's call is the one asked for)
    choice = client.chat.completions.create(**fields).choices[0]
    [call] = choice.message.tool_calls or []
    streamed, deltas, finish = _stream_calls(client, **fields)
    assert [(c["name"], c["arguments"]) for c in streamed] == [("get_weather", call.function.arguments)]
    assert streamed[0]["pieces"] >= 2 and len(deltas) >= 3
    assert finish == choice.finish_reason == ("stop" if tool_choice == "named" else "tool_calls")
    _validate(call)


def test_required_tool_choice_may_call_several_tools(char_server: ServerProcess, client: openai.OpenAI) -> None:
    """vLLM's required grammar is a list of at least one call: kvseal's hermes one lets calls
    follow the first (here made to, the end of text banned until max_tokens cuts one), each valid,
    streamed as they come under indices 0, 1, ..."""
    fields: dict[str, Any] = {"model": char_server.model_name, "messages": MESSAGES, "tools": TOOLS[1:],
                              "tool_choice": "required", "max_tokens": 200, "temperature": 1.0, "seed": 5,
                              "logit_bias": {"1": -100}}  # (the char model's end of text)
    choice = client.chat.completions.create(**fields).choices[0]
    calls = choice.message.tool_calls or []
    assert len(calls) >= 2 and choice.finish_reason == "length", choice
    for call in calls:
        _validate(call)
    streamed, _, _ = _stream_calls(client, **fields)
    assert [(c["name"], c["arguments"]) for c in streamed[:len(calls)]] == \
        [(c.function.name, c.function.arguments) for c in calls]
    for cut in streamed[len(calls):]:  # the call max_tokens cut, as far as it was sent: never whole
        with pytest.raises(json.JSONDecodeError):
            json.loads(cut["arguments"])


def test_required_tool_choice_without_parallel_calls_is_one_call() -> None:
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"})
    assert tool_setup(body, "hermes").grammar.kind == "tool_calls"  # type: ignore[union-attr]
    assert tool_setup(body.model_copy(update={"parallel_tool_calls": False}), "hermes").grammar.kind == "tool_call"  # type: ignore[union-attr]
    for parser in (MistralToolParser(), PythonicToolParser()):
        schemas = [call_schema("f", WEATHER)]
        assert json.loads(parser.forced_call(schemas).schema or "")["maxItems"] == 1
        assert "maxItems" not in json.loads(parser.forced_call(schemas, is_parallel=True).schema or "")


def test_a_streamed_call_that_turns_out_broken_on_the_server(char_server: ServerProcess,
                                                              client: openai.OpenAI) -> None:
    """A call cut by max_tokens after its arguments began: what was sent stays (arguments that
    are no whole JSON), the text comes as content, as unstreamed, and the finish reason is the
    unstreamed one."""
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": true}}\n</tool_call>'
    fields: dict[str, Any] = {"model": char_server.model_name, "messages": MESSAGES, "tools": TOOLS,
                              "max_tokens": 60, "temperature": 0, "extra_body": {"guided_regex": _regex_of(written)}}
    choice = client.chat.completions.create(**fields).choices[0]
    assert (choice.message.tool_calls, choice.finish_reason) == ([], "length")
    chunks = list(client.chat.completions.create(**fields, stream=True))
    content = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
    assert content == choice.message.content and written.startswith(content)
    [delta, *pieces] = [d for chunk in chunks for c in chunk.choices for d in c.delta.tool_calls or []]
    assert delta.function is not None and delta.function.name == "get_weather" and delta.index == 0
    sent = (delta.function.arguments or "") + "".join(d.function.arguments or "" for d in pieces if d.function)
    assert content.split('"arguments": ')[1].startswith(sent) and sent
    with pytest.raises(json.JSONDecodeError):
        json.loads(sent)
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["length"]


def test_tool_results_in_the_history(char_server: ServerProcess, client: openai.OpenAI) -> None:
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "celsius": true}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "-3"}]
    out = client.chat.completions.create(model=char_server.model_name, messages=history, tools=TOOLS,
                                         max_tokens=4, temperature=0, tool_choice="none")
    assert out.choices[0].message.tool_calls == [] and out.choices[0].finish_reason == "length"
    tokens = httpx.post(f"{char_server.url}/tokenize", headers={"Authorization": "Bearer key-alice"},
                        json={"messages": history, "return_token_strs": True}, timeout=30).json()
    rendered = "".join(tokens["token_strs"])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": true}}</tool_call>' in rendered
    assert rendered.endswith("<tool>-3<assistant>")


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
])
def test_bad_tool_requests_are_400(char_server: ServerProcess, body: dict[str, Any], param: str) -> None:
    response = httpx.post(f"{char_server.base_url}/chat/completions", headers={"Authorization": "Bearer key-alice"},
                          json={"messages": MESSAGES, "max_tokens": 2} | body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def _regex_of(text: str) -> str:
    """A regex matching exactly `text` (its newlines as the regex escape `\\n`)."""
    return "\\n".join(re.escape(line) for line in text.split("\n"))


def test_text_after_a_hermes_call_streams_as_it_is_written(char_server: ServerProcess,
                                                             client: openai.OpenAI) -> None:
    """What the model writes after a `</tool_call>` is sent as it comes (the character model
    writes it a token at a time: many chunks before the last), as vLLM's hermes stream sends it,
    and the content streamed adds up to the unstreamed message's."""
    after = "Then the time, and more."
    written = ('On it.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": true}}\n'
               f"</tool_call>\n{after}")
    fields: dict[str, Any] = {"model": char_server.model_name, "messages": MESSAGES, "tools": TOOLS,
                              "max_tokens": 200, "temperature": 0, "extra_body": {"guided_regex": _regex_of(written)}}
    message = client.chat.completions.create(**fields).choices[0].message
    assert message.content == f"On it.\n\n{after}" and len(message.tool_calls or []) == 1
    chunks = list(client.chat.completions.create(**fields, stream=True))
    pieces = [c.delta.content for chunk in chunks for c in chunk.choices if c.delta.content]
    assert "".join(pieces) == message.content
    num_before = next(i for i in range(len(pieces) + 1) if "".join(pieces[:i]) == "On it.")
    assert len(pieces) - num_before > 1, pieces  # one piece would be the text held to the answer's end


def test_parallel_tool_calls_false_keeps_the_first_call(char_server: ServerProcess, client: openai.OpenAI) -> None:
    """vLLM keeps only the first parsed call when `parallel_tool_calls` is false (tool_choice
    auto); streamed and unstreamed answers agree, and true (or absent) keeps both."""
    first = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    second = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": true}}\n</tool_call>'
    fields: dict[str, Any] = {"model": char_server.model_name, "messages": MESSAGES, "tools": TOOLS,
                              "max_tokens": 200, "temperature": 0}
    for parallel, names in ((False, ["get_time"]), (True, ["get_time", "get_weather"])):
        body = fields | {"parallel_tool_calls": parallel,
                         "extra_body": {"guided_regex": _regex_of(f"{first}\n{second}")}}
        choice = client.chat.completions.create(**body).choices[0]
        assert [c.function.name for c in choice.message.tool_calls or []] == names
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        deltas = [d for chunk in client.chat.completions.create(**body, stream=True)
                  for c in chunk.choices for d in c.delta.tool_calls or []]
        assert [d.function.name for d in deltas if d.function and d.function.name] == names


def test_a_text_response_format_beside_a_forced_call_asks_for_nothing(char_server: ServerProcess,
                                                                      client: openai.OpenAI) -> None:
    """response_format {"type": "text"} is the default (vLLM takes it beside any tool_choice);
    a JSON one beside a required call is still refused (test_bad_tool_requests_are_400)."""
    out = client.chat.completions.create(model=char_server.model_name, messages=MESSAGES, tools=TOOLS,
                                         max_tokens=200, temperature=1.0, seed=3, tool_choice="required",
                                         response_format={"type": "text"})
    assert out.choices[0].message.tool_calls is not None
    _validate(out.choices[0].message.tool_calls[0])


def test_tools_need_the_parser_flag(server: ServerProcess) -> None:
    response = httpx.post(f"{server.base_url}/chat/completions", headers={"Authorization": "Bearer key-alice"},
                          json={"messages": MESSAGES, "tools": TOOLS}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
    assert "--tool-call-parser" in response.json()["error"]["message"]


def test_hermes_parser() -> None:
    parser = HermesToolParser()
    text = 'Let me check.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = parser.parse(text)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
    assert parser.parse("no calls") == ("no calls", [])
    broken = "<tool_call>{oops}</tool_call>"
    assert parser.parse(broken) == (broken, []), "a block that is not a call stays text"
    for block in ('<tool_call>{"name": "Bob", "age": 3}</tool_call>', '<tool_call>{"name": "f"}</tool_call>',
                  '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>'):
        assert parser.parse(block) == (block, []), "as vLLM's parser: a call needs its arguments, an object"


def test_tool_call_stream_holds_back_a_partial_tag() -> None:
    stream = ToolCallStream(HermesToolParser())
    assert stream.feed("Hi <tool").content == "Hi"  # (the space too: the parser drops it before a call)
    assert stream.feed('_call>\n{"name": "f", "arguments": {}}\n</tool_call>').content == ""
    rest, _, has_calls = stream.finish()
    assert rest == "" and has_calls
    plain = ToolCallStream(HermesToolParser())
    assert plain.feed("a <").content == "a"
    assert plain.finish() == (" <", [], False)


def _streamed(parser: Any, pieces: list[str]) -> tuple[str, list[tuple[str, str]], bool]:
    """(the content, each index's call as its deltas add up, whether the answer has calls) of a
    stream fed `pieces`; each index's first delta comes first, with its name."""
    stream, content, calls = ToolCallStream(parser), "", {}

    def add(deltas: list[CallDelta]) -> None:
        for delta in deltas:
            if delta.name is not None:
                assert delta.index == len(calls) and delta.id, "indices are handed out in order, each with an id"
                calls[delta.index] = (delta.name, "")
            name, arguments = calls[delta.index]
            calls[delta.index] = (name, arguments + delta.arguments)

    for piece in pieces:
        step = stream.feed(piece)
        content += step.content
        add(step.calls)
    rest, deltas, has_calls = stream.finish()
    add(deltas)
    return content + rest, [calls[index] for index in range(len(calls))], has_calls


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'


@pytest.mark.parametrize(("parser", "text"), [
    (HermesToolParser(), f"{CALL}\n{CALL}\nDone."),  # text after the calls: streamed, it was lost
    (HermesToolParser(), f"Sure! {CALL}"),
    (HermesToolParser(), f"Sure!\n\n{CALL}\n\nAnd more.\n"),
    (HermesToolParser(), f'{CALL}\n<tool_call>\n{{"name": "add", "argu'),  # cut by max_tokens: kept as content
    (HermesToolParser(), "  no calls at all  "),
    (HermesToolParser(), f"  {CALL}  "),
    (HermesToolParser(),  # arguments before the name, written as json.dumps would not write them
     '<tool_call>{"arguments":{"b":[1,2.50,-0,1E2],"s":"\\u00e9\\ud83d\\ude00\\"\\/"},"name":"f"}</tool_call>'),
    (Llama3JsonToolParser(), '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": 1}}'),
    (Llama3JsonToolParser(), '{"not": "a call"} and text'),
    (Llama3JsonToolParser(), "plain text {with braces}"),
    (Llama3JsonToolParser(), '{"name": "Bob", "age": 3}'),  # a record with a name, not a call
    (HermesToolParser(), f'<tool_call>{{"name": "Bob"}}</tool_call> {CALL}'),
    (MistralToolParser(), '[TOOL_CALLS] [{"name": "f", "arguments": {}}]'),
    (MistralToolParser(), "Sure [not calls]"),
    (MistralToolParser(), '[{"name": "Bob", "age": 3}]'),
    (PythonicToolParser(), '[get_time(zone="CET"), get_weather(city="Oslo", celsius=True)]'),
    (PythonicToolParser(), '<|python_start|>[get_time(zone="CET")]<|python_end|>'),
    (PythonicToolParser(), "[see](the docs) first"),
    (PythonicToolParser(), "Sure: [get_time(zone='CET')]"),
    (Qwen3CoderToolParser(PARAMS), "Sure.\n\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n"
                                   "</function>\n</tool_call>\n<tool_call>\n<function=f>\n</function>\n</tool_call>"),
    (Qwen3CoderToolParser(PARAMS), "<tool_call>\n<function=get_time>\n<parameter=zone>\nCE"),  # cut by max_tokens
])
def test_streamed_content_adds_up_to_the_unstreamed_content(parser: Any, text: str) -> None:
    """However the text arrives (here cut at every point into two pieces, and one character at a
    time), the content a stream sends adds up to the message's content, and the calls match: a
    call begun and then found no call (cut by max_tokens) is left never whole."""
    content, calls = parser.parse(text)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        streamed_content, streamed_calls, has_calls = _streamed(parser, pieces)
        assert streamed_content == (content or ""), pieces
        assert _whole(streamed_calls) == [(c.name, c.arguments) for c in calls] and has_calls == bool(calls), pieces


def _added_up(deltas: list[Any]) -> list[tuple[str, str]]:
    """Each index's call as a client adds up its streamed deltas (the name on its first)."""
    calls: dict[int, tuple[str, str]] = {}
    for delta in deltas:
        name, arguments = calls.get(delta.index, (delta.function.name, ""))
        calls[delta.index] = (name, arguments + (delta.function.arguments or ""))
    return [calls[index] for index in sorted(calls)]


def _whole(calls: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The calls whose arguments are a whole JSON object; the others are left a beginning of one."""
    whole = []
    for name, arguments in calls:
        try:
            json.loads(arguments)
        except ValueError:
            assert arguments.startswith("{"), arguments
            continue
        whole.append((name, arguments))
    return whole


def test_a_streamed_hermes_call_comes_as_it_is_written() -> None:
    """The name (with the id) once the arguments begin, then the arguments as they come, in the
    text json.dumps gives them (the unstreamed call's), their last `}` when the block's end tag
    has come and the call is read."""
    stream = ToolCallStream(HermesToolParser())
    fed = [stream.feed(piece) for piece in
           ["Sure. <tool_call>\n", '{"name": "get_weather", ', '"arguments": {', '"city":"Os', 'lo", "days": 1',
            "2, ", '"celsius": true}', "}\n</tool_", "call>"]]
    assert "".join(step.content for step in fed) == "Sure."
    steps = [step.calls for step in fed]
    assert [[c.as_openai() for c in step] for step in steps[:3]] == [[], [], [
        {"index": 0, "id": steps[2][0].id, "type": "function", "function": {"name": "get_weather", "arguments": "{"}}]]
    assert steps[2][0].id.startswith("call_")  # type: ignore[union-attr]
    assert [[(c.index, c.name, c.arguments) for c in step] for step in steps[3:]] == [
        [(0, None, '"city": "Os')], [(0, None, 'lo", "days": ')], [(0, None, "12, ")], [(0, None, '"celsius": true')],
        [], [(0, None, "}")]]
    assert stream.finish() == ("", [], True)


@pytest.mark.parametrize(("text", "sent"), [
    ('<tool_call>\n{"name": "f", "arguments": {"a": "long', '{"a": "long'),  # cut by max_tokens
    ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2}}\n</tool_call>', '{"a": [1, '),  # broken JSON
    ('<tool_call>\n{"name": "f", "arguments": {"a": "<b></tool_call>"}}\n</tool_call>', '{"a": "<b>'),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}, "extra"\n</tool_call>', '{"a": 1'),
])
def test_a_streamed_call_that_turns_out_no_call_is_content(text: str, sent: str) -> None:
    """A block that is no call, found so after part of its call was sent: the part stays sent (no
    delta can take it back), never whole arguments; the text comes as content, as unstreamed,
    and the answer, having no call, does not end with "tool_calls". (vLLM's hermes stream drops
    the rest of such a text and ends with "tool_calls".)"""
    content, calls = HermesToolParser().parse(text)
    assert (content, calls) == (text, [])
    assert _streamed(HermesToolParser(), list(text)) == (text, [("f", sent)], False)


def test_a_call_after_one_that_turned_out_no_call_takes_the_next_index() -> None:
    text = f'<tool_call>{{"name": "f", "arguments": {{"a": 1, "a": 2}}}}</tool_call>\n{CALL}'
    content, calls = HermesToolParser().parse(text)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 2}'), ("add", '{"a": 1}')]
    assert _streamed(HermesToolParser(), list(text)) == (
        "", [("f", '{"a": 1, "a'), ("f", '{"a": 2}'), ("add", '{"a": 1}')], True), \
        "a key written twice: json.loads keeps the last value, in the first one's place"
    assert _streamed(FirstCallOnly(HermesToolParser()), list(text)) == (
        "", [("f", '{"a": 1, "a'), ("f", '{"a": 2}')], True), "parallel_tool_calls false: no further call"


def test_canonical_json_is_what_json_dumps_writes() -> None:
    """However the raw text arrives, the canonical text so far begins the whole value's
    `json.dumps(json.loads(raw), ensure_ascii=False)`; what json.loads refuses stops it."""
    for raw in ['{"a":1,"b":[1,2.50,-0,1e5,true,null,{}],"c":{"d":"x\\u00e9\\n\\"q\\ud83d\\ude00"}}',
                '{ "s" : "\\/\\b\\f\\t\\r", "k": [ ] , "e":{ } }', '{"x": "é😀", "y": 123456789012345678901234}']:
        whole = json.dumps(json.loads(raw), ensure_ascii=False)
        for cut in range(len(raw) + 1):
            reader = CanonicalJson()
            reader.feed(raw[:cut])
            assert whole.startswith(reader.text), (raw, cut)
            reader.feed(raw[cut:])
            assert (reader.text, reader.failed) == (whole, False)
    for raw in ['{"a": NaN}', '{"a": 1e999}', '{"a": "\x01"}', '{"a": tru}', '{"a": 01}', '{"a": "\\x"}', '{"a": 1,}',
                '{"a": 1, "a": 2}', '{"a" 1}', '{"a": "\\ud83d"}', '{"a": "\\ud83dx"}', '{"a": "\\ude00"}',
                '{"\\ud800": 1}']:  # (a lone surrogate: no UTF-8 can carry it)
        reader = CanonicalJson()
        reader.feed(raw)
        assert reader.failed, raw


@pytest.mark.parametrize("body", ['{"name": "f", "arguments": {"note": "\\ud800x"}}',
                                  '{"name": "\\udc00", "arguments": {}}'])
def test_a_call_with_a_lone_surrogate_is_content_streamed_or_not(body: str) -> None:
    """A lone surrogate escape decodes to a character no UTF-8 can carry: as a call it could not
    be sent (it was a 500, or a stream cut without an error). It is no call: the block is
    content, its escape plain ASCII, whole and streamed alike."""
    text = f"<tool_call>\n{body}\n</tool_call>"
    content, calls = HermesToolParser().parse(text)
    assert (content, calls) == (text, [])
    stream = ToolCallStream(HermesToolParser())
    sent = [stream.feed(char) for char in text]
    rest, _, has_calls = stream.finish()
    assert not has_calls and "".join(step.content for step in sent) + rest == text
    for piece in [d.arguments for step in sent for d in step.calls]:
        piece.encode("utf-8")  # (raises on a lone surrogate)


# ---- llama3_json (Llama 3.1-3.3): the answer is JSON calls ---------------------------------------

def test_llama3_json_parser() -> None:
    parser = Llama3JsonToolParser()
    content, calls = parser.parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    for text in ("The answer is 4.", '{"name": "f", "parameters": {}} and then text', '{"a": 1}', "{oops",
                 ' {"name": "f"}', '{"name": "Bob", "age": 3}', '{"name": "f", "parameters": [1]}'):
        assert parser.parse(text) == (text, []), "anything but calls alone is content, as it is"


def test_llama3_json_stream_holds_what_may_be_a_call() -> None:
    stream = ToolCallStream(Llama3JsonToolParser())
    assert stream.feed("  ").content == "" and stream.feed('{"name": "f", ').content == ""
    step = stream.feed('"parameters": {"a": true}}')
    assert step.content == "" and [(c.index, c.name, c.arguments) for c in step.calls] == [(0, "f", '{"a": true')]
    assert [(c.index, c.arguments) for c in stream.finish()[1]] == [(0, "}")], "the last `}` once the answer is read"
    tagged = ToolCallStream(Llama3JsonToolParser())
    assert tagged.feed("<|python").content == ""
    plain = ToolCallStream(Llama3JsonToolParser())
    assert plain.feed(" Hel").content == " Hel" and plain.feed("lo").content == "lo"
    assert plain.finish() == ("", [], False)


@pytest.fixture(scope="module")
def llama3_server(char_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(char_dir, tmp_path_factory.mktemp("llama3-tools"), keys=KEYS,
                         extra_args=["--tool-call-parser", "llama3_json", "--enable-auto-tool-choice",
                                     "--max-model-len", "1024"])
    proc.start()
    yield proc
    proc.terminate()


def test_llama3_json_calls_forced_and_free(llama3_server: ServerProcess) -> None:
    """tool_choice required: the grammar is one `{"name", "parameters"}` object (no Hermes tags),
    parsed into a call; auto: a call the model writes in the Llama format (held to it here by a
    regex) is parsed, streamed or not; an answer that is not a call stays content."""
    client = client_for(llama3_server, "key-alice")
    out = client.chat.completions.create(model=llama3_server.model_name, messages=MESSAGES, tools=TOOLS, n=2,
                                         max_tokens=100, temperature=1.0, seed=1, tool_choice="required")
    for choice in out.choices:
        assert choice.message.tool_calls is not None and choice.finish_reason == "tool_calls", choice
        _validate(choice.message.tool_calls[0])
    written = '\\{"name": "get_time", "parameters": \\{"zone": "CET"\\}\\}'
    out = client.chat.completions.create(model=llama3_server.model_name, messages=MESSAGES, tools=TOOLS,
                                         max_tokens=100, temperature=0, extra_body={"guided_regex": written})
    [call] = out.choices[0].message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"zone": "CET"})
    deltas = [d for chunk in client.chat.completions.create(
        model=llama3_server.model_name, messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=0, stream=True,
        extra_body={"guided_regex": written}) for c in chunk.choices for d in c.delta.tool_calls or []]
    # the call streams as it is written: its name once, then its arguments in pieces that add up
    assert [d.function.name for d in deltas if d.function and d.function.name] == ["get_time"]
    assert {d.index for d in deltas} == {0}
    assert json.loads("".join(d.function.arguments or "" for d in deltas if d.function)) == {"zone": "CET"}
    out = client.chat.completions.create(model=llama3_server.model_name, messages=MESSAGES, tools=TOOLS,
                                         max_tokens=100, temperature=0, extra_body={"guided_regex": "It is [a-z]{3}"})
    assert out.choices[0].message.tool_calls == [] and out.choices[0].message.content.startswith("It is ")


def test_an_object_without_arguments_is_content_not_a_call(llama3_server: ServerProcess) -> None:
    """vLLM's llama3_json parser (as its hermes and mistral ones) needs a call's arguments key:
    an answer `{"name": "Bob", "age": 3}` stays content (nothing of it lost), ends with "stop",
    streamed or not."""
    client = client_for(llama3_server, "key-alice")
    answer = '{"name": "Bob", "age": 3}'
    fields: dict[str, Any] = {"model": llama3_server.model_name, "messages": MESSAGES, "tools": TOOLS,
                              "tool_choice": "auto", "max_tokens": 100, "temperature": 0,
                              "extra_body": {"guided_regex": re.escape(answer)}}
    out = client.chat.completions.create(**fields)
    choice = out.choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (answer, [], "stop")
    chunks = list(client.chat.completions.create(**fields, stream=True))
    deltas = [c.delta for chunk in chunks for c in chunk.choices]
    assert "".join(d.content or "" for d in deltas) == answer and not any(d.tool_calls for d in deltas)
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["stop"]


# ---- mistral: [TOOL_CALLS] and a JSON list of calls -----------------------------------------------

def test_mistral_parser() -> None:
    parser = MistralToolParser()
    content, calls = parser.parse('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    assert all(re.fullmatch("[A-Za-z0-9]{9}", c.as_openai()["id"]) for c in calls), "what its templates take"
    assert parser.parse('[{"name": "f", "arguments": {}}]')[1][0].name == "f", "the special token is usually dropped"
    for text in ("[1, 2]", "[]", "[see](link)", "plain", '[{"name": "f"}] and more', '[{"name": "f"}]',
                 '[{"name": "f", "arguments": {}}, {"name": "Bob", "age": 3}]'):
        assert parser.parse(text) == (text, [])
    stream = ToolCallStream(MistralToolParser())
    assert stream.feed("[TOOL").content == ""
    step = stream.feed('_CALLS] [{"name": "f", "arguments": {}}]')
    assert step.content == "" and [(c.name, c.arguments) for c in step.calls] == [("f", "{")]
    assert re.fullmatch("[A-Za-z0-9]{9}", step.calls[0].id or ""), "Mistral's ids, streamed too"
    assert [c.arguments for c in stream.finish()[1]] == ["}"]
    plain = ToolCallStream(MistralToolParser())
    assert plain.feed("Sure").content == "Sure"


def test_mistral_and_pythonic_forced_call_is_one_valid_call(char_dir: Path) -> None:
    """The grammar a required tool_choice gets with `--tool-call-parser mistral` (and `pythonic`,
    whose calls' Python arguments no grammar could hold to a schema): a JSON list of one call,
    which each parser reads back, its arguments valid."""
    from kvseal import LLM, SamplingParams
    from kvseal.server.tools import call_schema

    schemas = [call_schema(name, PARAMS[name]) for name in PARAMS]
    grammar = MistralToolParser().forced_call(schemas)
    assert PythonicToolParser().forced_call(schemas) == grammar
    llm = LLM(str(char_dir), kv_cache_tokens=1024, page_size=4, dtype="float32", grammar_compile_workers=1)
    try:
        outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured=grammar)
                                         for s in (1, 2)])
    finally:
        llm.engine.close()
    for out in outs:
        assert out.finish_reason.value == "stop"
        for parser in (MistralToolParser(), PythonicToolParser()):
            content, [call] = parser.parse(out.text)
            assert content is None
            jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])


# ---- pythonic (Llama 3.2 and 4): a Python list of calls -------------------------------------------

def test_pythonic_parser_reads_literals_and_never_runs_anything() -> None:
    parser = PythonicToolParser()
    text = """[get_weather(city="Oslo", celsius=True, days=[1, 2.5], extra={"a": None}), get_time()]"""
    content, calls = parser.parse(f"<|python_start|>{text}<|python_end|>")
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "celsius": True, "days": [1, 2.5], "extra": {"a": None}}), ("get_time", {})]
    assert parser.parse("[f(a=(1, 'é'))]")[1][0].arguments == '{"a": [1, "é"]}'
    for text in ("The answer is 4.", "[1, 2]", "[]", "[f(1)]", "[f(a=b)]", "[f(**k)]", "[m.f(a=1)]", "[f(a=1)] more",
                 "[f(a={1, 2})]", "[f(a=b'x')]", "[f(a=true)]", "[f(a=__import__('os').system('true'))]",
                 "[f(a=1) for f in x]", "[f(a=1)", "[" * 5000 + "]" * 5000, '[{"name": "f"}]'):
        assert parser.parse(text) == (text, []), text
    stream = ToolCallStream(PythonicToolParser())
    assert stream.feed("<|python").content == ""
    step = stream.feed('_start|>[f(a="x")]')
    assert step.content == "" and [(c.name, c.arguments) for c in step.calls] == [("f", '{"a": "x"')]
    assert [c.arguments for c in stream.finish()[1]] == ["}"]
    plain = ToolCallStream(PythonicToolParser())
    assert plain.feed("Sure").content == "Sure"


def test_pythonic_calls_on_the_server(char_dir: Path, tmp_path: Path) -> None:
    """`--tool-call-parser pythonic`: a call the model writes in the format (held to it here by
    a regex) comes back as the same call, streamed or not; a required call is enforced."""
    server = ServerProcess(char_dir, tmp_path, keys=KEYS, extra_args=["--tool-call-parser", "pythonic",
                                                                      "--max-model-len", "1024"]).start()
    try:
        client = client_for(server, "key-alice")
        written = re.escape('[get_time(zone="CET"), get_weather(city="Oslo", celsius=False)]')
        fields: dict[str, Any] = {"model": server.model_name, "messages": MESSAGES, "tools": TOOLS,
                                  "max_tokens": 100, "temperature": 0, "extra_body": {"guided_regex": written}}
        expected = [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Oslo", "celsius": False})]
        choice = client.chat.completions.create(**fields).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []] == \
            expected
        deltas = [d for chunk in client.chat.completions.create(**fields, stream=True) for c in chunk.choices
                  for d in c.delta.tool_calls or []]
        assert [(name, json.loads(arguments)) for name, arguments in _added_up(deltas)] == expected
        out = client.chat.completions.create(model=server.model_name, messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                             temperature=1.0, seed=3, tool_choice="required", parallel_tool_calls=False)
        [call] = out.choices[0].message.tool_calls or []
        _validate(call)
    finally:
        server.terminate()


@pytest.mark.parametrize("parser", [HermesToolParser(), Llama3JsonToolParser(), MistralToolParser(),
                                    PythonicToolParser(), Qwen3CoderToolParser()],
                         ids=lambda parser: type(parser).__name__)
def test_brackets_nested_past_the_parsers_depth_are_content(parser: Any) -> None:
    """A model can write (and a tenant's regex make it write) brackets deeper than Python's JSON
    and Python parsers go: that answer is content, not an exception in the response."""
    deep = "[" * 5000 + "]" * 5000
    for text in (deep, '{"name": "f", "arguments": ' + deep + "}", f"<tool_call>{deep}</tool_call>",
                 '<tool_call>{"name": "f", "arguments": {"a": ' + deep + "}}</tool_call>", f"[f(a={deep})]"):
        content, calls = parser.parse(text)
        assert (content, calls) == (text, []) or (isinstance(parser, HermesToolParser) and not calls)


def test_arguments_nested_just_within_the_decoders_depth_are_content() -> None:
    """Arguments the JSON decoder reads but the encoder, a few frames deeper, cannot write back
    (a window of a few depths just under the recursion limit, wherever the stack stands): every
    depth around the limit is content or a call, never an exception."""
    for depth in range(sys.getrecursionlimit() - 200, sys.getrecursionlimit() + 50):
        text = '{"name": "f", "parameters": ' + '{"a": ' * depth + "1" + "}" * (depth + 1)
        content, calls = Llama3JsonToolParser().parse(text)
        assert (content, calls) == (text, []) or calls


@pytest.mark.parametrize(("parser", "text"), [
    (MistralToolParser(), '[{"name": "f", "arguments": {"x": NaN}}]'),
    (Llama3JsonToolParser(), '{"name": "f", "parameters": {"x": Infinity}}'),
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": {"x": -Infinity}}</tool_call>'),
    (PythonicToolParser(), "[f(x=1e999)]"),
])
def test_arguments_strict_json_has_no_number_for_are_content(parser: Any, text: str) -> None:
    """Python's JSON reads NaN and Infinity; a client's strict JSON parser (JavaScript's) would
    refuse the arguments, so the answer stays content."""
    assert parser.parse(text)[1] == []


# ---- qwen3_coder (Qwen3-Coder): <tool_call> blocks of XML-like parameters ----------------------------

def _qwen_call(name: str, **values: str) -> str:
    """A call as Qwen3-Coder's chat template writes it."""
    parameters = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in values.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


TYPED = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
    "celsius": {"type": "boolean"}, "options": {"type": "object"}, "hours": {"type": "array"},
    "limit": {"type": ["integer", "null"]}, "unit": {"enum": ["C", "F"]}, "code": {"type": "string"}}}


def test_qwen3_coder_parser_types_values_by_the_tools_schema() -> None:
    parser = Qwen3CoderToolParser({"get_weather": TYPED, "get_time": TIME})
    text = "Let me check.\n\n" + _qwen_call(
        "get_weather", city="Paris", days="3", ratio="0.5", celsius="True", options='{"a": [1, null]}',
        hours="[9, 'noon']", limit="null", unit=" F", code="  def f():\n      return 1\n",
        extra="3") + "\n" + _qwen_call("get_time", zone="CET")
    content, calls = parser.parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "ratio": 0.5, "celsius": True, "options": {"a": [1, None]},
                         "hours": [9, "noon"], "limit": None, "unit": "F",
                         "code": "  def f():\n      return 1\n",  # only the template's newlines go
                         "extra": "3"}),  # a parameter the schema does not name stays text
        ("get_time", {"zone": "CET"})]
    # a value that is not of its declared type stays the text the model wrote, as in vLLM
    [call] = parser.parse(_qwen_call("get_weather", days="three", ratio="NaN", celsius="yes", options="[1]",
                                     hours="[1j]", city="null"))[1]
    assert json.loads(call.arguments) == {"days": "three", "ratio": "NaN", "celsius": "yes", "options": "[1]",
                                          "hours": "[1j]", "city": "null"}
    [call] = parser.parse(_qwen_call("lookup", days="3", flag="true"))[1]
    assert (call.name, json.loads(call.arguments)) == ("lookup", {"days": "3", "flag": "true"}), \
        "a tool not in the request is still a call (as every parser here takes it), its values text"
    assert parser.parse("<tool_call><function=get_time><parameter=zone>UTC</function></tool_call>")[1][0].arguments \
        == '{"zone": "UTC"}', "a missing </parameter> before the function's end, as vLLM reads it"


def test_qwen3_coder_parser_leaves_anything_else_as_content() -> None:
    parser = Qwen3CoderToolParser({"f": TYPED})
    deep = "[" * 5000 + "]" * 5000
    [call] = parser.parse(_qwen_call("f", hours=deep, options="__import__('os').system('true')"))[1]
    assert json.loads(call.arguments) == {"hours": deep, "options": "__import__('os').system('true')"}
    call_text = _qwen_call("f", city="Oslo")
    for text in ("The answer is 4.", "<function=f>\n</function>", call_text[:-5], call_text.replace("</function>", ""),
                 "<tool_call>\n<function=f>\nstray text<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
                 "<tool_call>\n<function=f>\n</function>\n<function=g>\n</function>\n</tool_call>",
                 "<tool_call>\n<function=>\n</function>\n</tool_call>", "<tool_call>\n</tool_call>",
                 f"<tool_call>{deep}</tool_call>"):
        assert parser.parse(text) == (text, []), text
    content, calls = parser.parse(f"<tool_call>\n{{\"name\": \"f\"}}\n</tool_call>\n{call_text}\nDone.")
    assert content == '<tool_call>\n{"name": "f"}\n</tool_call>\n\nDone.' and [c.name for c in calls] == ["f"]
    stream = ToolCallStream(Qwen3CoderToolParser())
    assert stream.feed("Sure <tool").content == "Sure"
    step = stream.feed("_call>\n<function=f>")
    assert step.content == "" and [(c.name, c.arguments) for c in step.calls] == [("f", "{")]
    step = stream.feed("\n</function>\n</tool_call>")
    assert step.content == "" and [(c.index, c.arguments) for c in step.calls] == [(0, "}")]
    assert stream.finish() == ("", [], True)


def test_qwen3_coder_forced_call_is_one_valid_call(char_dir: Path) -> None:
    """The grammar a required tool_choice gets with `--tool-call-parser qwen3_coder`: one block
    in the format itself (xgrammar's structural tag), which the parser reads back, its arguments
    valid, a string held to a length among them."""
    from kvseal import LLM, SamplingParams
    from kvseal.server.tools import call_schema

    note = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
            "required": ["text", "n"], "additionalProperties": False}
    params = PARAMS | {"note": note}
    parser = Qwen3CoderToolParser(params)
    grammar = parser.forced_call([call_schema(name, params[name]) for name in params])
    llm = LLM(str(char_dir), kv_cache_tokens=2048, page_size=4, dtype="float32", grammar_compile_workers=1)
    try:
        outs = llm.generate(["a"] * 6, [SamplingParams(max_tokens=150, temperature=1.0, seed=s, structured=grammar)
                                        for s in range(6)])
    finally:
        llm.engine.close()
    assert {re.search("<function=([a-z_]+)>", out.text).group(1) for out in outs} == set(params)  # type: ignore[union-attr]
    for out in outs:
        assert out.finish_reason.value == "stop" and out.text.startswith("<tool_call>\n<function=")
        content, [call] = parser.parse(out.text)
        assert content is None
        jsonschema.validate(json.loads(call.arguments), params[call.name])


def test_qwen3_coder_calls_on_the_server(char_dir: Path, tmp_path: Path) -> None:
    """`--tool-call-parser qwen3_coder`: calls the model writes in the format (held to it here by
    a regex), after some content, come back as the same calls with values typed by the tools'
    schemas, streamed or not; a required call is enforced."""
    server = ServerProcess(char_dir, tmp_path, keys=KEYS, extra_args=["--tool-call-parser", "qwen3_coder",
                                                                      "--max-model-len", "1024"]).start()
    try:
        client = client_for(server, "key-alice")
        written = "Sure.\n" + _qwen_call("get_time", zone="CET") + "\n" + \
            _qwen_call("get_weather", city="Oslo", celsius="false")
        fields: dict[str, Any] = {"model": server.model_name, "messages": MESSAGES, "tools": TOOLS,
                                  "max_tokens": 300, "temperature": 0,
                                  "extra_body": {"guided_regex": _regex_of(written)}}
        expected = [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Oslo", "celsius": False})]
        choice = client.chat.completions.create(**fields).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []] == \
            expected
        chunks = list(client.chat.completions.create(**fields, stream=True))
        deltas = [d for chunk in chunks for c in chunk.choices for d in c.delta.tool_calls or []]
        assert [(name, json.loads(arguments)) for name, arguments in _added_up(deltas)] == expected
        assert "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices) == "Sure."
        cut = client.chat.completions.create(**fields | {"max_tokens": 40}).choices[0]
        assert (cut.finish_reason, cut.message.tool_calls) == ("length", []), "a block cut off is content"
        assert written.startswith(cut.message.content or "")
        out = client.chat.completions.create(model=server.model_name, messages=MESSAGES, tools=TOOLS, n=2,
                                             max_tokens=120, temperature=1.0, seed=3, tool_choice="required")
        for choice in out.choices:
            [call] = choice.message.tool_calls or []
            _validate(call)
            assert choice.finish_reason == "tool_calls"
    finally:
        server.terminate()


def test_qwen3_coder_bounded_strings_read_as_the_enforced_grammar_counted_them() -> None:
    """The enforced call's grammar counts every character between the tags against a string's
    length or pattern, the newlines and the whitespace it lets in too: the parser's reading of
    such a string is one those bounds hold for, so a forced call's arguments validate."""
    schema = {"type": "object", "properties": {"x": {"type": "string", "minLength": 3},
                                               "y": {"type": "string", "maxLength": 5},
                                               "z": {"type": "string", "pattern": "^[a-z]+$"}}}
    parser = Qwen3CoderToolParser({"f": schema})
    for written, expected in [("\na\n", "\na\n"), (" a ", " a "), ("\nab\n", "\nab\n"), ("\nabcd\n", "abcd")]:
        [call] = parser.parse(f"<tool_call>\n<function=f>\n<parameter=x>{written}</parameter>\n</function>\n"
                              f"</tool_call>")[1]
        assert json.loads(call.arguments) == {"x": expected}, written
        jsonschema.validate(json.loads(call.arguments), schema)
    [call] = parser.parse(_qwen_call("f", y="Paris", z=" abc"))[1]
    assert json.loads(call.arguments) == {"y": "Paris", "z": "abc"}


def test_qwen3_coder_forced_call_refuses_a_parameter_name_the_format_cannot_write() -> None:
    from kvseal.server.tools import call_schema

    for name in ("a>b", "a<b", "a\nb"):
        with pytest.raises(InvalidParameter, match="rename the parameter") as refused:
            Qwen3CoderToolParser().forced_call([call_schema("f", {"type": "object",
                                                                  "properties": {name: {"type": "string"}}})])
        assert refused.value.param == "tools"


NESTED = {"type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"],
          "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "order"}}])
@pytest.mark.parametrize("parser", ["hermes", "mistral", "pythonic", "llama3_json"])
def test_a_forced_call_takes_parameters_with_definitions(tool_choice: Any, parser: str) -> None:
    """Pydantic writes nested models as `$defs` its `$ref`s name from the parameters' root; in the
    call's schema the parameters sit under `arguments`, so the definitions go to the call's root
    (as vLLM gathers them), where the grammar and a validator find them."""
    import xgrammar

    tools = [{"type": "function", "function": {"name": "order", "parameters": NESTED}}, *TOOLS]
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": tools, "tool_choice": tool_choice})
    grammar = tool_setup(body, parser).grammar
    assert grammar is not None and grammar.schema is not None
    schema = json.loads(grammar.schema)
    key = "parameters" if parser == "llama3_json" else "arguments"
    call = {"name": "order", key: {"item": {"sku": "A-1"}}}
    instance = call if grammar.kind in ("tool_call", "tool_calls") or parser == "llama3_json" else [call]
    jsonschema.validate(instance, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(json.dumps(instance).replace('"sku"', '"skew"')), schema)
    if grammar.kind == "tool_calls":
        tool_calls_grammar(grammar.schema)
    elif grammar.kind == "tool_call":
        tool_call_grammar(grammar.schema)
    else:
        xgrammar.Grammar.from_json_schema(grammar.schema)


def test_two_tools_defining_one_name_differently_are_refused() -> None:
    other = json.loads(json.dumps(NESTED))
    other["$defs"]["Item"]["required"] = []
    tools = [{"type": "function", "function": {"name": "order", "parameters": NESTED}},
             {"type": "function", "function": {"name": "refund", "parameters": other}}]
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": tools, "tool_choice": "required"})
    with pytest.raises(InvalidParameter, match=r"\$defs/Item differently") as refused:
        tool_setup(body, "hermes")
    assert refused.value.param == "tools"


def test_qwen3_coder_keeps_each_tools_definitions_as_they_came() -> None:
    """Qwen3-Coder's tag holds each tool's parameters as a schema of their own: their definitions
    stay where they are, and two tools may define one name differently there."""
    other = json.loads(json.dumps(NESTED))
    other["$defs"]["Item"]["required"] = []
    tools = [{"type": "function", "function": {"name": "order", "parameters": NESTED}},
             {"type": "function", "function": {"name": "refund", "parameters": other}}]
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": tools, "tool_choice": "required"})
    grammar = tool_setup(body, "qwen3_coder").grammar
    assert grammar is not None and grammar.kind == "qwen3_coder_call"
    assert [t["parameters"] for t in json.loads(grammar.schema or "")] == [NESTED, other]


@pytest.mark.parametrize("ref", ["#", "#/properties/item"])
def test_a_forced_call_refuses_a_reference_into_the_parameters_root(ref: str) -> None:
    """In a call's schema the parameters' root is the call object: `{"$ref": "#"}` (a recursive
    tree) would hold the model to a call inside a call, a shape the tool's own schema refuses."""
    tree = {"type": "object", "properties": {"item": {"type": "string"}, "child": {"$ref": ref}}}
    tools = [{"type": "function", "function": {"name": "tree", "parameters": tree}}]
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": tools, "tool_choice": "required"})
    with pytest.raises(InvalidParameter, match=f"cannot hold \\$ref '{re.escape(ref)}'") as refused:
        tool_setup(body, "hermes")
    assert refused.value.param == "tools"
    auto = body.model_copy(update={"tool_choice": "auto"})
    assert tool_setup(auto, "hermes").grammar is None  # nothing is enforced: the tool is taken as it is
