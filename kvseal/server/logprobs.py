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
        "top_logprobs": [{token_text(t): _finite(v) for t, v in lp.top} for lp in lps],
        "text_offset": offsets.next([lp.token_id for lp in lps]),
    }


def chat_logprobs(lps: list[TokenLogprobsMsg], token_text: TokenText, token_bytes: TokenBytes) -> dict[str, Any]:
    """`bytes` are each token's own bytes: joined, they rebuild the content's UTF-8."""
    return {"content": [_chat_entry(lp.token_id, lp.logprob, token_text, token_bytes) | {
        "top_logprobs": [_chat_entry(t, v, token_text, token_bytes) for t, v in lp.top]} for lp in lps]}


def _chat_entry(token_id: int, logprob: float, token_text: TokenText, token_bytes: TokenBytes) -> dict[str, Any]:
    return {"token": token_text(token_id), "logprob": _finite(logprob), "bytes": list(token_bytes(token_id))}
