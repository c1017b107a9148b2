"""Function calling on chat completions: `tools`, `tool_choice`, and the Hermes parser.

The tool definitions go to the model's own chat template (`apply_chat_template(tools=...)`).
The model answers with Hermes/Qwen calls, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`, which `HermesToolParser` turns into OpenAI's `tool_calls` (as vLLM's `hermes`
parser does); the server flag `--tool-call-parser hermes` selects it, and without it a request
with tools is refused. `tool_choice`:
- "auto" (the default with tools): the model may call tools; calls are parsed from its text.
- "none": tools are rendered but nothing is parsed; the text is the answer.
- "required" / a named function: one call is enforced with the grammar (the call's JSON must
  match one tool's — or the named tool's — parameters schema), then parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvseal.errors import InvalidParameter
from kvseal.server.protocol import ChatCompletionRequest, NamedToolChoice
from kvseal.types import StructuredOutput

TOOL_CALL_PARSERS = ("hermes",)
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
START_TAG = "<tool_call>"


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index} | call


class HermesToolParser:
    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content outside the calls or None, the calls). A block that is not a JSON object with
        a string `name` is left in the content, as text, rather than guessed at."""
        calls, kept = [], []
        position = 0
        for match in _CALL.finditer(text):
            call = _parse_call(match.group(1))
            if call is None:
                continue
            kept.append(text[position:match.start()])
            position = match.end()
            calls.append(call)
        kept.append(text[position:])
        content = "".join(kept).strip()
        return (content or None) if calls else text, calls


def _parse_call(body: str) -> ParsedToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return ParsedToolCall(value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False))


@dataclass(frozen=True)
class ToolSetup:
    """What a chat request's tools mean for prompting, sampling and formatting."""

    definitions: list[dict[str, Any]] | None  # for the chat template
    parse_calls: bool
    grammar: StructuredOutput | None  # enforced call (required / named)
    grammar_tools: frozenset[str] = frozenset()  # names of the tools the grammar is built from


def tool_setup(body: ChatCompletionRequest, parser: str | None) -> ToolSetup:
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidParameter("tool_choice needs tools; send tools or omit tool_choice", param="tool_choice")
        return ToolSetup(None, False, None)
    if parser is None:
        raise InvalidParameter("this server does not parse tool calls; start it with --tool-call-parser hermes "
                               "or remove tools", param="tools")
    if body.response_format is not None and choice not in (None, "none", "auto"):
        raise InvalidParameter("response_format cannot be combined with a required or named tool_choice",
                               param="response_format")
    if body.parallel_tool_calls is False and choice in (None, "auto"):
        raise InvalidParameter("parallel_tool_calls=false is only honoured with tool_choice 'required' or a "
                               "named function (exactly one call); omit it or set it to true",
                               param="parallel_tool_calls")
    definitions = [t.model_dump(exclude_none=True) for t in body.tools]
    if choice == "none":
        return ToolSetup(definitions, False, None)
    grammar = _enforced_call(body, choice)
    return ToolSetup(definitions, True, grammar, _grammar_tools(body, choice) if grammar is not None else frozenset())


def _grammar_tools(body: ChatCompletionRequest, choice: Any) -> frozenset[str]:
    assert body.tools is not None
    if isinstance(choice, NamedToolChoice):
        return frozenset([choice.function.name])
    return frozenset(t.function.name for t in body.tools)


def _enforced_call(body: ChatCompletionRequest, choice: Any) -> StructuredOutput | None:
    assert body.tools is not None
    tools = {t.function.name: t.function.parameters or {"type": "object"} for t in body.tools}
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in tools:
            raise InvalidParameter(f"tool_choice names function {name!r}, which is not in tools "
                                   f"({', '.join(sorted(tools))})", param="tool_choice")
        return StructuredOutput("tool_call", json.dumps(_call_schema(name, tools[name])))
    if choice == "required":
        schemas = [_call_schema(name, params) for name, params in tools.items()]
        return StructuredOutput("tool_call", json.dumps(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}))
    return None


def _call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


class ToolCallStream:
    """One streamed choice with tool parsing: text before a `<tool_call>` streams as content;
    from the tag on it is held, and the calls go out as `tool_calls` deltas when the choice ends
    (each call's whole arguments in one delta, which OpenAI's clients accumulate as usual)."""

    def __init__(self, parser: HermesToolParser) -> None:
        self._parser = parser
        self._text = ""
        self._num_sent = 0

    def content_delta(self, new_text: str) -> str:
        """The part of the text that can be shown as content now."""
        self._text += new_text
        start = self._text.find(START_TAG)
        safe = start if start >= 0 else _before_partial_tag(self._text)
        delta = self._text[self._num_sent:max(safe, self._num_sent)]
        self._num_sent += len(delta)
        return delta

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """(content not yet sent, the calls), once the choice has ended."""
        content, calls = self._parser.parse(self._text)
        if not calls:
            rest = self._text[self._num_sent:]
            self._num_sent = len(self._text)
            return rest, []
        return "", calls


def _before_partial_tag(text: str) -> int:
    """Where a possible beginning of `<tool_call>` at the end of `text` starts (len(text) if none)."""
    for size in range(min(len(START_TAG) - 1, len(text)), 0, -1):
        if START_TAG.startswith(text[-size:]):
            return len(text) - size
    return len(text)
