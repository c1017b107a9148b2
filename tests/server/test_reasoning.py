"""`--reasoning-parser` (vLLM's qwen3 / deepseek_r1): a thinking model's `<think>` block goes to
the chat message's `reasoning` (and `reasoning_content`), the rest to `content`, whole and
streamed alike; a structured output constrains only what follows the block. The
character-level model's `<think>` tokens are steered with `logit_bias`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from char_model import END_THINK, THINK
from hypothesis import given
from hypothesis import strategies as st
from server_process import ServerProcess

from kvseal.errors import ConfigError
from kvseal.server.reasoning import (
    ReasoningMarkers,
    ReasoningStream,
    prompt_opens_reasoning,
    reasoning_markers,
    split_reasoning,
)

EOS = 1
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
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
    calls: dict[int, dict[str, Any]] = {}  # by index: a call's name comes first, its arguments in pieces
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body | {"stream": True}, timeout=60,
                      headers={"Authorization": "Bearer key-alice"}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    delta = choice["delta"]
                    assert delta.get("reasoning") == delta.get("reasoning_content")
                    reasoning += delta.get("reasoning") or ""
                    content += delta.get("content") or ""
                    for piece in delta.get("tool_calls") or []:
                        call = calls.setdefault(piece["index"], {"function": {"name": "", "arguments": ""}})
                        for key in ("name", "arguments"):
                            call["function"][key] += piece.get("function", {}).get(key) or ""
    return reasoning, content, [calls[index] for index in sorted(calls)]


OPEN_BLOCK = {"messages": [{"role": "user", "content": "think"}, {"role": "assistant", "content": "<think>"}],
              "add_generation_prompt": False, "continue_final_message": True}  # as DeepSeek-R1's template leaves it
NO_EOS = {str(EOS): -100}  # the grammar still ends the answer (nothing else is allowed then)
ANY = "(?s).*"


@pytest.mark.parametrize(("fields", "reasoning", "content"), [
    # the first token opens the block, the regex holds after it
    ({"guided_regex": "[a-z]{2}", "logit_bias": NO_EOS | {str(THINK): 3, str(END_THINK): 3}}, ANY, "[a-z]{2}"),
    ({"guided_regex": "[a-z]{4}", "logit_bias": {str(THINK): -100}}, None, "[a-z]{4}"),  # or begins the answer
    # the prompt leaves the block open
    (OPEN_BLOCK | {"guided_regex": "[a-z]{2}", "logit_bias": NO_EOS | {str(END_THINK): 3}}, ANY, "[a-z]{2}"),
    (OPEN_BLOCK | {"guided_regex": "[a-z]{2}", "max_tokens": 12, "logit_bias": {str(END_THINK): -100}},
     ".+", None),  # cut while thinking: no answer, content null (vLLM's)
    (OPEN_BLOCK | {"logit_bias": NO_EOS | {str(END_THINK): 3},
                   "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
     ANY, "JSON"),
])
def test_reasoning_is_split_from_the_content(reasoning_server: ServerProcess, fields: dict[str, Any],
                                             reasoning: str | None, content: str | None) -> None:
    """The structured output constrains the answer only: the reasoning block before it is free,
    so a thinking model can still think (vLLM's behaviour). Before the grammar waited for the
    block, the prompt's open block took the whole constrained answer and the content was empty."""
    body = CHAT | fields
    message = post(reasoning_server, body)["choices"][0]["message"]
    if reasoning is None:
        assert "reasoning" not in message and "reasoning_content" not in message
    else:
        assert re.fullmatch(reasoning, message["reasoning"]) and message["reasoning_content"] == message["reasoning"]
        assert "</think>" not in message["reasoning"]
    if content is None:
        assert message["content"] is None, message
    elif content == "JSON":
        assert isinstance(json.loads(message["content"])["ok"], bool), message
    else:
        assert re.fullmatch(content, message["content"] or ""), message
    streamed_reasoning, streamed_content, _ = stream(reasoning_server, body)
    assert (streamed_reasoning, streamed_content) == (message.get("reasoning") or "", message["content"] or "")


CALL_F = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}}}]


def test_a_tool_call_after_the_reasoning_is_parsed(reasoning_server: ServerProcess) -> None:
    body = CHAT | OPEN_BLOCK | {"max_tokens": 120, "tools": CALL_F, "logit_bias": NO_EOS | {str(END_THINK): 3},
                                "guided_regex": '<tool_call>\n\\{"name": "f", "arguments": \\{"a": true\\}\\}'
                                                '\n</tool_call>'}
    choice = post(reasoning_server, body)["choices"][0]
    assert choice["message"]["reasoning"] and choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"a": true}'}
    reasoning, content, calls = stream(reasoning_server, body)
    assert reasoning == choice["message"]["reasoning"] and content == ""
    assert [c["function"] for c in calls] == [call["function"]]


def test_a_forced_tool_call_waits_for_the_reasoning_too(reasoning_server: ServerProcess) -> None:
    """tool_choice "required" is a grammar as well: it constrains what follows the block."""
    body = CHAT | OPEN_BLOCK | {"max_tokens": 200, "tools": CALL_F, "tool_choice": "required",
                                "parallel_tool_calls": False, "logit_bias": NO_EOS | {str(END_THINK): 3}}
    choice = post(reasoning_server, body)["choices"][0]
    assert choice["message"]["reasoning"], choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "f" and isinstance(json.loads(call["function"]["arguments"])["a"], bool)


def test_reasoning_markers_must_be_tokens_of_the_vocabulary(char_dir: Path, server_model_dir: Path) -> None:
    """As vLLM's parsers: a model that writes `</think>` in several tokens is refused at start-up,
    since its grammar could not tell where the reasoning ends."""
    from transformers import AutoTokenizer

    assert reasoning_markers("qwen3", AutoTokenizer.from_pretrained(char_dir)) == ReasoningMarkers(THINK, END_THINK)
    assert reasoning_markers(None, AutoTokenizer.from_pretrained(server_model_dir)) is None
    with pytest.raises(ConfigError, match="--reasoning-parser deepseek_r1 needs <think> and </think> to be tokens"):
        reasoning_markers("deepseek_r1", AutoTokenizer.from_pretrained(server_model_dir))


def test_include_reasoning_false_leaves_the_reasoning_out(reasoning_server: ServerProcess) -> None:
    """vLLM's `include_reasoning: false`: the same answer, its reasoning not sent, whole or streamed."""
    body = CHAT | OPEN_BLOCK | {"guided_regex": "[a-z]{2}", "logit_bias": NO_EOS | {str(END_THINK): 3}}
    full = post(reasoning_server, body)["choices"][0]["message"]
    assert full["reasoning"]
    message = post(reasoning_server, body | {"include_reasoning": False})["choices"][0]["message"]
    assert "reasoning" not in message and "reasoning_content" not in message
    assert message["content"] == full["content"]
    assert stream(reasoning_server, body | {"include_reasoning": False})[:2] == ("", full["content"])


@pytest.mark.parametrize("include_reasoning", [True, False])
def test_a_streamed_answer_carries_every_tokens_logprobs_reasoning_too(reasoning_server: ServerProcess,
                                                                      include_reasoning: bool) -> None:
    """With logprobs, each step's chunk carries its tokens' logprobs, a step of reasoning only
    too (its reasoning chunk, or an empty delta when the reasoning is left out): the stream
    holds as many as the whole answer, one per generated token."""
    body = CHAT | OPEN_BLOCK | {"guided_regex": "[a-z]{2}", "logit_bias": NO_EOS | {str(END_THINK): 3},
                                "logprobs": True, "include_reasoning": include_reasoning}
    whole = post(reasoning_server, body)
    assert len(whole["choices"][0]["logprobs"]["content"]) == whole["usage"]["completion_tokens"]
    streamed: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{reasoning_server.base_url}/chat/completions", json=body | {"stream": True},
                      timeout=60, headers={"Authorization": "Bearer key-alice"}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed += (choice.get("logprobs") or {}).get("content") or []
    assert streamed == whole["choices"][0]["logprobs"]["content"]
