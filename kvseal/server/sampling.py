"""Request body → `SamplingParams`, applying the tenant's max_tokens cap and the model's
generation defaults (for the fields the request omits).

The prompt is checked against the context first, so an over-long prompt always gets
`context_length_exceeded` (never an error about a parameter derived from it). An omitted
`max_tokens` is the rest of the context window (`max_model_len` − prompt tokens), capped
by the model's `max_new_tokens` (generation defaults) and the tenant's `max_tokens`, as vLLM's
`get_max_tokens` does; a request's own `max_tokens` is kept even above `max_new_tokens` (vLLM
treats the file's value as a default, not a limit). Raises `InvalidParameter` naming the field;
`SamplingParams` itself validates every value.
"""

from __future__ import annotations

from kvseal.admission import AdmissionLimits
from kvseal.errors import InvalidParameter
from kvseal.generation_defaults import GenerationDefaults
from kvseal.server.auth import Tenant
from kvseal.server.front_door import check_context
from kvseal.server.protocol import GenerationBody
from kvseal.types import SamplingParams

NEUTRAL = GenerationDefaults()


def build_sampling_params(body: GenerationBody, *, max_tokens: int | None, num_prompt_tokens: int,
                          limits: AdmissionLimits, logprobs: int | None, tenant: Tenant,
                          defaults: GenerationDefaults = NEUTRAL,
                          max_tokens_param: str = "max_tokens",
                          prompt_logprobs: int | None = None) -> SamplingParams:
    """`max_tokens` is what the client asked for, in the field `max_tokens_param` (which its
    errors name); `num_prompt_tokens` counts the prompt before any truncation the request asked
    for; `defaults` fill the sampling fields it omitted. `prompt_logprobs`: the request's, or
    what its endpoint derives (completions' echo with logprobs)."""
    if body.truncate_prompt_tokens is not None:  # -1: the most a prompt may have (kvseal.admission.admit)
        keep = body.truncate_prompt_tokens
        num_prompt_tokens = min(num_prompt_tokens, limits.max_prompt_tokens if keep == -1 else keep)
    check_context(num_prompt_tokens, 1 if max_tokens is None else max_tokens, limits)
    if body.stream_options is not None and not body.stream:
        raise InvalidParameter("stream_options is only allowed with stream=true", param="stream_options")
    if body.prompt_logprobs is not None and body.stream:  # as vLLM: its stream chunks have no place for them
        raise InvalidParameter("prompt_logprobs is not available with stream=true; send stream=false",
                               param="prompt_logprobs")
    return SamplingParams(
        max_tokens=_max_tokens(max_tokens, max(1, limits.max_model_len - num_prompt_tokens), tenant,
                               max_tokens_param, defaults.max_tokens),
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=defaults.top_k if body.top_k is None else body.top_k,
        min_p=defaults.min_p if body.min_p is None else body.min_p,
        seed=body.seed,
        stop=body.stop_list,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        n=body.n or 1,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=defaults.repetition_penalty if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias),
        prompt_logprobs=prompt_logprobs,
        allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
        cache_salt=body.cache_salt,
    )


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI sends token ids as JSON object keys (strings); each must be a decimal integer in
    ASCII digits (`str.isdecimal` alone would take any script's digits, which `int` reads)."""
    pairs = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdecimal()):
            raise InvalidParameter(f"logit_bias keys must be token ids (decimal integers in ASCII digits 0-9), "
                                   f"got {key!r}", param="logit_bias")
        pairs.append((int(key), value))
    return tuple(pairs)


def _max_tokens(asked: int | None, remaining: int, tenant: Tenant, param: str, default: int | None) -> int:
    """`default` (the model's max_new_tokens) stands in only for an omitted value."""
    cap = tenant.max_tokens
    if asked is None:
        return min(n for n in (remaining, cap, default) if n is not None)
    if cap is not None and asked > cap:
        raise InvalidParameter(f"{param}={asked} exceeds the limit of tenant '{tenant.name}', {cap}; "
                               f"ask for at most {cap} tokens", param=param)
    return asked
