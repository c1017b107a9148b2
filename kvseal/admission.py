"""The one admission function (I1), used by every entry point and re-checked by every role.

It runs before any page, slot, message, sender or receiver exists for the request. A request
it rejects is terminal: nothing may replace, pad, queue or compute it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvseal.errors import ContextLengthExceeded, InvalidParameter
from kvseal.types import SamplingParams


@dataclass(frozen=True)
class AdmissionLimits:
    """`limit = min(max_model_len, kv_cache_tokens)` for the prompt; prompt + max_tokens
    must also fit in `max_model_len`."""

    max_model_len: int
    kv_cache_tokens: int
    vocab_size: int

    @property
    def max_prompt_tokens(self) -> int:
        return min(self.max_model_len, self.kv_cache_tokens)


def admit(prompt_token_ids: list[int], params: SamplingParams, limits: AdmissionLimits) -> list[int]:
    """Return the prompt token ids to run, or raise a `RequestRejected` subclass.

    Truncation happens only when the request asked for it (`truncate_prompt_tokens`, which
    keeps the last N tokens, as vLLM does; -1 keeps the last `max_prompt_tokens`); otherwise an
    over-long prompt is rejected.
    """
    ids = list(prompt_token_ids)
    keep = params.truncate_prompt_tokens
    if keep is not None:
        ids = ids[-(limits.max_prompt_tokens if keep == -1 else keep):]
    if not ids:
        raise InvalidParameter("the prompt is empty: send at least one token", param="prompt")
    _check_token_ids(ids, limits.vocab_size)
    _check_param_token_ids(params, limits.vocab_size)
    check_context_length(len(ids), 1 if params.max_tokens is None else params.max_tokens, limits)
    return ids


def with_max_tokens(params: SamplingParams, num_prompt_tokens: int, limits: AdmissionLimits) -> SamplingParams:
    """`params` with `max_tokens=None` resolved to the rest of the context, as vLLM does (the
    prompt was admitted with room for at least one token)."""
    if params.max_tokens is not None:
        return params
    return dataclasses.replace(params, max_tokens=limits.max_model_len - num_prompt_tokens)


def check_context_length(num_prompt_tokens: int, max_tokens: int, limits: AdmissionLimits) -> None:
    """Raise `ContextLengthExceeded` unless the request fits (I1). Pure; touches no state."""
    if num_prompt_tokens > limits.max_prompt_tokens:
        which = "the context window" if limits.max_model_len <= limits.kv_cache_tokens else "the KV cache pool"
        message = (
            f"This model's maximum context length is {limits.max_model_len} tokens and the KV "
            f"cache holds {limits.kv_cache_tokens} tokens, so prompts may have at most "
            f"{limits.max_prompt_tokens} tokens (limited by {which}). Your prompt has "
            f"{num_prompt_tokens} tokens. Shorten the prompt, or set truncate_prompt_tokens."
        )
    elif num_prompt_tokens + max_tokens > limits.max_model_len:
        message = (
            f"This model's maximum context length is {limits.max_model_len} tokens. You "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} for the completion). Reduce the prompt or max_tokens."
        )
    else:
        return
    raise ContextLengthExceeded(
        message,
        num_prompt_tokens=num_prompt_tokens,
        max_tokens=max_tokens,
        max_model_len=limits.max_model_len,
        kv_cache_tokens=limits.kv_cache_tokens,
    )


def _check_token_ids(ids: list[int], vocab_size: int) -> None:
    bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidParameter(
            f"prompt token id {bad!r} is outside the vocabulary [0, {vocab_size})", param="prompt"
        )


def _check_param_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids in sampling parameters index the logits, so they must be in the vocabulary."""
    gate = params.structured.reasoning if params.structured is not None else None
    markers = () if gate is None else (gate.start_token_id, gate.end_token_id)
    for param, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias]),
                       ("allowed_token_ids", params.allowed_token_ids or ()), ("reasoning", markers)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidParameter(f"{param} names token id {bad}, outside the vocabulary [0, {vocab_size})",
                                   param=param)
