"""Chat messages in the shapes clients send back, on chat completions and /tokenize's chat shape.

A tool round trip appends the `openai` client's assistant message (`model_dump()`, with None for
what was absent, or `model_dump(exclude_none=True)`, without `content`) to the history; vLLM and
OpenAI take both. Every accepted per-message field reaches the chat template, as vLLM passes
message dicts through, and `tools` count in /tokenize as in the chat request.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import KEYS, ServerProcess, client_for

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
           "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
MESSAGES: list[Any] = [{"role": "user", "content": "weather?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": "Bearer key-alice"}, timeout=60)


def rendered(server: ServerProcess, body: dict[str, Any]) -> str:
    """The prompt /tokenize renders (the character-level model: one token a character)."""
    response = post(server, "/tokenize", body | {"return_token_strs": True})
    assert response.status_code == 200, response.text
    return "".join(response.json()["token_strs"])


def test_the_openai_clients_assistant_message_round_trips(char_server: ServerProcess) -> None:
    """`message.model_dump()` has `refusal`, `audio`, `function_call`, `annotations` as None (a
    null is not sent); with `exclude_none=True` it has tool_calls and no `content`, which OpenAI
    allows on an assistant turn of calls. Both render as the same turn, in chat and /tokenize."""
    client = client_for(char_server, "key-alice")
    out = client.chat.completions.create(model=char_server.model_name, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                         temperature=0, tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}})
    message = out.choices[0].message
    assert message.tool_calls is not None and message.content is None
    answer = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "-3"}
    prompts = []
    for dump in (message.model_dump(), message.model_dump(exclude_none=True)):
        history = [*MESSAGES, dump, answer]
        again = client.chat.completions.create(model=char_server.model_name, messages=history, tools=TOOLS,
                                               max_tokens=2, temperature=0)
        assert again.choices[0].finish_reason in ("length", "stop", "tool_calls")
        prompts.append(rendered(char_server, {"messages": history}))
    assert prompts[0] == prompts[1] and '<tool_call>{"name": "get_weather"' in prompts[0]


@pytest.mark.parametrize("assistant", [
    {"role": "assistant", "content": "yo", "refusal": None, "audio": None, "function_call": None,
     "annotations": None},
    {"role": "assistant", "content": None, "refusal": "I can't help with that."},
    {"role": "assistant", "refusal": "I can't help with that."},
    {"role": "assistant", "tool_calls": [CALL]},
    {"role": "assistant", "content": None, "tool_calls": [CALL], "refusal": None},
])
def test_assistant_messages_clients_echo_back_are_taken(char_server: ServerProcess, assistant: dict[str, Any]) -> None:
    """OpenAI's rule: an assistant turn may leave content out when it has tool_calls (or, as the
    API answered it, a refusal); fields sent as null are not sent (vLLM takes all of these)."""
    body = {"messages": [*MESSAGES, assistant, {"role": "user", "content": "ok"}]}
    response = post(char_server, "/v1/chat/completions", body | {"max_tokens": 2})
    assert response.status_code == 200, response.text
    assert post(char_server, "/tokenize", body).status_code == 200


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None}, {"role": "assistant"},
                                     {"role": "assistant", "tool_calls": []}])
def test_a_message_without_content_renders_as_empty_content(char_server: ServerProcess,
                                                             message: dict[str, Any]) -> None:
    """Content left out or null is "" (as vLLM takes it, and kvseal did before it took nulls as
    not sent): the same prompt as the message with `"content": ""`."""
    empty = {key: value for key, value in message.items() if key != "content"} | {"content": ""}
    assert rendered(char_server, {"messages": [*MESSAGES, message]}) == \
        rendered(char_server, {"messages": [*MESSAGES, empty]})


@pytest.mark.parametrize(("message", "words"), [
    ({"role": "user", "content": "hi", "refusal": "no"}, "assistant message's field"),
    ({"role": "user", "content": "hi", "reasoning_content": "hm"}, "assistant message's field"),
    ({"role": "assistant", "content": "hi", "reasoning": "a", "reasoning_content": "b"}, "differ"),
    ({"role": "assistant", "content": "hi", "function_call": {"name": "f", "arguments": "{}"}}, "function_call"),
])
def test_a_message_with_a_field_its_role_cannot_have_is_400(char_server: ServerProcess,
                                                            message: dict[str, Any], words: str) -> None:
    for path in ("/v1/chat/completions", "/tokenize"):
        response = post(char_server, path, {"messages": [message]})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages" and words in error["message"], error


def test_tokenize_renders_tools_as_chat_counts_them(char_server: ServerProcess) -> None:
    """vLLM's chat-shaped /tokenize takes `tools`: the count is the chat request's prompt_tokens,
    and a bad tool is the same 400 as on chat completions."""
    body = {"messages": MESSAGES, "tools": TOOLS}
    tokens = post(char_server, "/tokenize", body).json()
    chat = post(char_server, "/v1/chat/completions", body | {"max_tokens": 1}).json()
    assert tokens["count"] == chat["usage"]["prompt_tokens"] > post(char_server, "/tokenize",
                                                                    {"messages": MESSAGES}).json()["count"]
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(5001)}}}}
    for path in ("/tokenize", "/v1/chat/completions"):
        response = post(char_server, path, {"messages": MESSAGES, "tools": [bad]})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.text


NAMED_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}{% if m.name %}:{{ m.name }}{% endif %}>{{ m['content'] }}"
                  "{% if m.refusal %}!{{ m.refusal }}{% endif %}"
                  "{% if m.reasoning_content %}({{ m.reasoning_content }}){% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def named_server(char_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The character-level model with a template that renders `name`, `refusal` and `reasoning_content`."""
    proc = ServerProcess(char_dir, tmp_path_factory.mktemp("named"), keys=KEYS,
                         extra_args=["--chat-template", NAMED_TEMPLATE, "--max-model-len", "1024"])
    proc.start()
    yield proc
    proc.terminate()


def test_name_and_refusal_reach_the_template(named_server: ServerProcess) -> None:
    """vLLM passes a message's fields through to the template: a template that prints `m.name`
    sees it (and a refusal, with content null rendered as "", as kvseal renders it)."""
    messages = [{"role": "system", "content": "be brief", "name": "ops"},
                {"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": None, "refusal": "no"}]
    prompt = rendered(named_server, {"messages": messages, "add_generation_prompt": False})
    assert prompt == "<system:ops>be brief<user:ann>hi<assistant>!no"
    chat = post(named_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                                       "add_generation_prompt": False}).json()
    assert chat["usage"]["prompt_tokens"] == len(prompt)


def test_an_echoed_reasoning_reaches_the_template_under_either_name(named_server: ServerProcess) -> None:
    """The `openai` client's dump of a reasoning server's answer carries `reasoning` and
    `reasoning_content`; templates (Qwen3's) read `reasoning_content`, which either name fills."""
    for name in ("reasoning", "reasoning_content"):
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", name: "think"}]
        prompt = rendered(named_server, {"messages": messages, "add_generation_prompt": False})
        assert prompt == "<user>hi<assistant>yo(think)"
