"""`--reasoning-parser` (vLLM's qwen3 / deepseek_r1): a thinking model's `<think>` block goes to
the chat message's `reasoning` (and `reasoning_content`), the rest to `content`, whole and
streamed alike. The character-level model is held to an exact shape with `guided_regex`."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from server_process import ServerProcess

from kvseal.server.reasoning import ReasoningStream, prompt_opens_reasoning, split_reasoning

CHAT = {"messages": [{"role": "user", "content": "think"}], "temperature": 1.0, "seed": 5, "max_tokens": 60}


@pytest.mark.parametrize(("text", "open_at_start", "expected"), [
    ("<think>abc</think>de", False, ("abc", "de")),
    ("abc</think>de", True, ("abc", "de")),
    ("abc</think>de", False, (None, "abc</think>de")),
    ("<think>still thinking", False, ("still thinking", "")),
    ("still thinking", True, ("still thinking", "")),
    ("plain answer", False, (None, "plain answer")),
    ("<thin", False, (None, "<thin")),
    ("", True, ("", "")),
])
def test_split(text: str, open_at_start: bool, expected: tuple[str | None, str]) -> None:
    assert split_reasoning(text, open_at_start) == expected


def test_an_open_block_is_read_from_the_prompts_end() -> None:
    assert prompt_opens_reasoning("<assistant><think>\n")
    assert not prompt_opens_reasoning("<assistant><think>\n\n</think>\n\n")  # Qwen3, thinking off
    assert not prompt_opens_reasoning("<assistant>")


@given(st.text(alphabet="<>/thinkab", max_size=40), st.booleans(), st.lists(st.integers(1, 6), max_size=20))
def test_any_split_of_the_stream_gives_the_whole_split(text: str, open_at_start: bool, cuts: list[int]) -> None:
    """However the text arrives in deltas, the stream's parts add up to the whole split."""
    stream, reasoning, content, position = ReasoningStream(open_at_start), "", "", 0
    for size in [*cuts, len(text)]:
        r, c = stream.feed(text[position:position + size])
        reasoning, content, position = reasoning + r, content + c, position + size
    r, c = stream.finish()
    whole_reasoning, whole_content = split_reasoning(text, open_at_start)
    assert (reasoning + r, content + c) == (whole_reasoning or "", whole_content)
    assert stream.has_reasoning == (whole_reasoning is not None)


def post(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer key-alice"})
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def stream(server: ServerProcess, body: dict[str, Any]) -> tuple[str, str, list[dict[str, Any]]]:
    reasoning = content = ""
    calls: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body | {"stream": True}, timeout=60,
                      headers={"Authorization": "Bearer key-alice"}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    delta = choice["delta"]
                    assert delta.get("reasoning") == delta.get("reasoning_content")
                    reasoning += delta.get("reasoning") or ""
                    content += delta.get("content") or ""
                    calls += delta.get("tool_calls") or []
    return reasoning, content, calls


@pytest.mark.parametrize(("fields", "reasoning", "content"), [
    ({"guided_regex": "<think>[a-z]{3}</think>[a-z]{2}"}, "[a-z]{3}", "[a-z]{2}"),
    ({"guided_regex": "[a-z]{4}"}, None, "[a-z]{4}"),
    ({"guided_regex": "<think>[a-z]{30}</think>x", "max_tokens": 12}, "[a-z]{5}", ""),  # cut while thinking
    # the prompt leaves the block open (DeepSeek-R1's and Qwen3.5's templates do)
    ({"messages": [{"role": "user", "content": "think"}, {"role": "assistant", "content": "<think>"}],
      "add_generation_prompt": False, "continue_final_message": True,
      "guided_regex": "[a-z]{3}</think>[a-z]{2}"}, "[a-z]{3}", "[a-z]{2}"),
])
def test_reasoning_is_split_from_the_content(char_server: ServerProcess, fields: dict[str, Any],
                                             reasoning: str | None, content: str) -> None:
    body = CHAT | fields
    message = post(char_server, body)["choices"][0]["message"]
    if reasoning is None:
        assert "reasoning" not in message and "reasoning_content" not in message
    else:
        assert re.fullmatch(reasoning, message["reasoning"]) and message["reasoning_content"] == message["reasoning"]
    assert re.fullmatch(content, message["content"] or "")
    streamed_reasoning, streamed_content, _ = stream(char_server, body)
    assert (streamed_reasoning, streamed_content) == (message.get("reasoning") or "", message["content"] or "")


CALL_F = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}}}]


def test_a_tool_call_after_the_reasoning_is_parsed(char_server: ServerProcess) -> None:
    body = CHAT | {"max_tokens": 120, "tools": CALL_F,
                   "guided_regex": '<think>[a-z]{2}</think><tool_call>\n\\{"name": "f", "arguments": \\{"a": true\\}\\}'
                                   '\n</tool_call>'}
    choice = post(char_server, body)["choices"][0]
    assert re.fullmatch("[a-z]{2}", choice["message"]["reasoning"]) and choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"a": true}'}
    reasoning, content, calls = stream(char_server, body)
    assert reasoning == choice["message"]["reasoning"] and content == ""
    assert [c["function"] for c in calls] == [call["function"]]
