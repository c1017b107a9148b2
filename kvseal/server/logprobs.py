"""Token logprobs in the two OpenAI shapes (legacy completions and chat).

JSON has no infinity: a logprob below `LOGPROB_FLOOR` (or not a number) is reported as the
floor, as vLLM does.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from typing import Any

from kvseal.messages.msgs import TokenLogprobsMsg

LOGPROB_FLOOR = -9999.0
TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]


class TextOffsets:
    """Where each generated token starts in the response text, across a whole stream.

    The text is the UTF-8 decoding of the tokens' bytes (invalid bytes become U+FFFD), so a
    token that only continues a character (byte-level BPE splits emoji) starts where that
    character does, and the next character starts after it.
    """

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._num_chars = 0

    def next(self, token_ids: list[int]) -> list[int]:
        offsets = []
        for token_id in token_ids:
            offsets.append(self._num_chars)
            self._num_chars += len(self._decoder.decode(self._token_bytes(token_id)))
        return offsets


def _finite(value: float) -> float:
    return value if value == value and value > LOGPROB_FLOOR else LOGPROB_FLOOR


def completion_logprobs(lps: list[TokenLogprobsMsg], token_text: TokenText, offsets: TextOffsets) -> dict[str, Any]:
    """`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, offsets continuing `offsets`."""
    return {
        "tokens": [token_text(lp.token_id) for lp in lps],
        "token_logprobs": [_finite(lp.logprob) for lp in lps],
        "top_logprobs": [_legacy_top(lp, token_text) for lp in lps],
        "text_offset": offsets.next([lp.token_id for lp in lps]),
    }


def _legacy_top(lp: TokenLogprobsMsg, token_text: TokenText) -> dict[str, float]:
    """A position's `top_logprobs` in the legacy shape: the `logprobs` most likely tokens and,
    as OpenAI's and vLLM's always hold it, the position's own token (up to logprobs + 1)."""
    top = {token_text(t): _finite(v) for t, v in lp.top}
    top.setdefault(token_text(lp.token_id), _finite(lp.logprob))
    return top


def echoed_prompt_logprobs(prompt_token_ids: list[int], lps: list[TokenLogprobsMsg | None], token_text: TokenText,
                           offsets: TextOffsets) -> dict[str, Any]:
    """The prompt's part of an echoing completion's logprobs: every prompt token, the first
    without a logprob (`None`, as OpenAI and vLLM send it), offsets from the text's start."""
    return {
        "tokens": [token_text(t) for t in prompt_token_ids],
        "token_logprobs": [None if lp is None else _finite(lp.logprob) for lp in lps],
        "top_logprobs": [None if lp is None else _legacy_top(lp, token_text) for lp in lps],
        "text_offset": offsets.next(prompt_token_ids),
    }


def joined_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two completions-shaped logprobs one after the other (an echoed prompt's, then the output's)."""
    return {key: first[key] + then[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def vllm_prompt_logprobs(lps: list[TokenLogprobsMsg | None], token_text: TokenText) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), token id -> `{"logprob",
    "rank", "decoded_token"}`, the prompt token first (its rank among all tokens), then the top
    alternatives ranked 1..k."""
    def position(lp: TokenLogprobsMsg) -> dict[str, Any]:
        top = {str(t): _vllm_entry(v, rank, token_text(t)) for rank, (t, v) in enumerate(lp.top, start=1)}
        own = top.pop(str(lp.token_id), None) or _vllm_entry(lp.logprob, lp.rank, token_text(lp.token_id))
        return {str(lp.token_id): own, **top}
    return [None if lp is None else position(lp) for lp in lps]


def _vllm_entry(logprob: float, rank: int | None, text: str) -> dict[str, Any]:
    return {"logprob": _finite(logprob), "rank": rank, "decoded_token": text}


def chat_logprobs(lps: list[TokenLogprobsMsg], token_text: TokenText, token_bytes: TokenBytes) -> dict[str, Any]:
    """`bytes` are each token's own bytes: joined, they rebuild the content's UTF-8."""
    return {"content": [_chat_entry(lp.token_id, lp.logprob, token_text, token_bytes) | {
        "top_logprobs": [_chat_entry(t, v, token_text, token_bytes) for t, v in lp.top]} for lp in lps]}


def _chat_entry(token_id: int, logprob: float, token_text: TokenText, token_bytes: TokenBytes) -> dict[str, Any]:
    return {"token": token_text(token_id), "logprob": _finite(logprob), "bytes": list(token_bytes(token_id))}
