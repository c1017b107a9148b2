"""Token logprobs in the two OpenAI shapes (legacy completions and chat).

JSON has no infinity: a logprob below `LOGPROB_FLOOR` (or not a number) is reported as the
floor, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvseal.messages.msgs import TokenLogprobsMsg

LOGPROB_FLOOR = -9999.0
TokenText = Callable[[int], str]


def _finite(value: float) -> float:
    return value if value == value and value > LOGPROB_FLOOR else LOGPROB_FLOOR


def completion_logprobs(lps: list[TokenLogprobsMsg], token_text: TokenText, text_offset: int) -> dict[str, Any]:
    """`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` starting at `text_offset`."""
    tokens = [token_text(lp.token_id) for lp in lps]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(lp.logprob) for lp in lps],
        "top_logprobs": [{token_text(t): _finite(v) for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(lps: list[TokenLogprobsMsg], token_text: TokenText) -> dict[str, Any]:
    return {"content": [_chat_entry(lp.token_id, lp.logprob, token_text) | {
        "top_logprobs": [_chat_entry(t, v, token_text) for t, v in lp.top]} for lp in lps]}


def _chat_entry(token_id: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
