"""Bounds on body fields that depend on the engine's limits (the static ones are in `protocol`).

The chat template renders more than the messages' contents: the tool definitions, the
arguments of earlier tool calls, earlier refusals and reasoning. The prompt pre-check
(`PromptEncoder.chat_ids`) counts only the contents, so these are bounded here, before the
template or the tokenizer sees them: each may have at most as many characters (besides
whitespace) as a whole prompt can hold, that is the prompt limit (I1) times the most characters
one token covers. More could never fit in the context; refusing it up front keeps one request
from holding the tokenizer thread, which every tenant shares.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kvseal._testing.faults import Fault, is_active
from kvseal.admission import AdmissionLimits
from kvseal.errors import InvalidParameter
from kvseal.server.prompts import num_visible_chars
from kvseal.server.protocol import CHAT_NAMES, ChatMessage, ConversationNames
from kvseal.structured.schema import check_tools


def check_message_extras(messages: list[ChatMessage], limits: AdmissionLimits, max_token_chars: int,
                         names: ConversationNames = CHAT_NAMES) -> None:
    """Raise `InvalidParameter` when the messages' tool-call arguments, or their refusals and
    reasoning, have more characters than a prompt can hold (checked at the door, before the
    request takes a slot); the error names them as `names` says (the API the client used)."""
    if is_active(Fault.SKIP_DOOR_CHECKS):
        return
    limit = limits.max_prompt_tokens * max_token_chars
    arguments = (call.function.arguments for message in messages for call in message.tool_calls or [])
    _require_within(names.param, names.tool_calls, sum(num_visible_chars(a) for a in arguments), limit, limits)
    extras = (text for message in messages for text in (message.refusal, message.reasoning_text) if text is not None)
    _require_within(names.param, names.extras, sum(num_visible_chars(text) for text in extras), limit, limits)


async def check_tool_definitions(tools: list[dict[str, Any]], grammar_tools: frozenset[str], limits: AdmissionLimits,
                                 max_token_chars: int) -> None:
    """Every door check on a request's tool definitions, the same for chat completions and
    /tokenize's chat shape: each schema (off the event loop: a large one takes a while), then
    their size against what a prompt can hold."""
    await asyncio.to_thread(check_tools, tools, grammar_tools)
    check_tools_text(tools, limits, max_token_chars)


def check_tools_text(tools: list[dict[str, Any]], limits: AdmissionLimits, max_token_chars: int) -> None:
    """Raise `InvalidParameter` when the tool definitions have more characters than a prompt can
    hold. Run after each tool's own door checks (`structured.schema.check_tools`), so a tool
    over a schema limit is refused naming that limit."""
    if is_active(Fault.SKIP_DOOR_CHECKS):
        return
    tools_chars = sum(num_visible_chars(json.dumps(tool)) for tool in tools)
    _require_within("tools", "the tool definitions (as JSON)", tools_chars,
                    limits.max_prompt_tokens * max_token_chars, limits)


def _require_within(param: str, what: str, num_chars: int, limit: int, limits: AdmissionLimits) -> None:
    if num_chars > limit:
        raise InvalidParameter(
            f"{what} have {num_chars} characters besides whitespace; the chat template renders them into the "
            f"prompt, which may have at most {limits.max_prompt_tokens} tokens, at most {limit} such characters "
            f"on this model. Send less.", param=param)
