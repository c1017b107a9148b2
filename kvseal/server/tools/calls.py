"""The vocabulary of tool calls: a parsed call, its ids, the tags of the formats, and reading a
call from its JSON object (every parser's last step)."""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvseal._testing.faults import Fault, is_active

CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
START_TAG, END_TAG = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
# what json raises for text that is no JSON value: RecursionError for brackets nested past its
# depth, which a model can write (and a tenant's regex make it write)
NOT_JSON = (ValueError, RecursionError)


def openai_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_id() -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=openai_id)

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index} | call


def block_calls(text: str, read: Callable[[str], ParsedToolCall | None]) -> tuple[str | None, list[ParsedToolCall]]:
    """`parse` of a format whose calls are `<tool_call>` blocks anywhere in the text: (the text
    outside the calls or None, the calls); a block `read` makes no call of (None) is left in
    the content, as text."""
    calls, kept = [], []
    position = 0
    for match in CALL_BLOCK.finditer(text):
        call = read(match.group(1))
        if call is None:
            continue
        kept.append(text[position:match.start()])
        position = match.end()
        calls.append(call)
    kept.append(text[position:])
    content = "".join(kept).rstrip()  # (a stream shows the start as it comes: `ToolCallStream`)
    return (content if content.strip() else None) if calls else text, calls


def parse_json_call(body: str) -> ParsedToolCall | None:
    try:
        value = json.loads(body)
    except NOT_JSON:
        return None
    call = call_of(value, ("arguments",))
    if call is not None and is_active(Fault.STALE_TOOL_ARGUMENTS):
        return _with_stale_arguments(call)
    return call


_stale_arguments: list[str] = []  # Fault.STALE_TOOL_ARGUMENTS only: the last call read, in any request


def _with_stale_arguments(call: ParsedToolCall) -> ParsedToolCall:
    """The fault's call: the arguments of the call read before it, whichever request it was in."""
    previous = _stale_arguments[-1] if _stale_arguments else call.arguments
    _stale_arguments[:] = [call.arguments]
    return dataclasses.replace(call, arguments=previous)


def call_of(value: Any, argument_keys: tuple[str, ...], call_id: str | None = None) -> ParsedToolCall | None:
    """A call from its JSON object: a string `name`, and an object of arguments under the first
    of `argument_keys` it has; None for anything else. As vLLM's parsers do, an object without
    its arguments (`{"name": "Bob", "age": 3}`: an answer that happens to have a name) is not a
    call: guessing empty arguments would turn the answer into a call and lose the rest of it."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not is_utf8(value["name"]):
        return None
    arguments = next((value[key] for key in argument_keys if key in value), None)
    if not isinstance(arguments, dict):
        return None
    text = arguments_json(arguments)
    if text is None:
        return None
    call = ParsedToolCall(value["name"], text)
    return call if call_id is None else dataclasses.replace(call, id=call_id)


def arguments_json(arguments: dict[Any, Any]) -> str | None:
    """A call's arguments as strict JSON text; None for arguments no client could read back:
    NaN or Infinity (Python's JSON reads them, strict JSON has none), nesting past the
    encoder's depth, or a lone surrogate (a `\\ud800` escape with no pair: no UTF-8 can carry
    it, so the answer could not be sent; the block stays content, its escape plain ASCII)."""
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except NOT_JSON:
        return None
    return text if is_utf8(text) else None


def is_utf8(text: str) -> bool:
    """Whether `text` can be sent (encoded as UTF-8): not when it holds a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def before_partial(text: str, tag: str) -> int:
    """Where a possible beginning of `tag` at the end of `text` starts (len(text) if none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return len(text) - size
    return len(text)
