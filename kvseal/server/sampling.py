"""Request body → `SamplingParams`, applying the tenant's max_tokens cap.

Raises `InvalidParameter` naming the field; `SamplingParams` itself validates every value.
"""

from __future__ import annotations

from kvseal.errors import InvalidParameter
from kvseal.server.auth import Tenant
from kvseal.server.protocol import GenerationBody
from kvseal.types import SamplingParams


def build_sampling_params(body: GenerationBody, *, max_tokens: int | None, default_max_tokens: int,
                          logprobs: int | None, tenant: Tenant) -> SamplingParams:
    """`max_tokens` is what the client asked for (None: `default_max_tokens`, capped for the tenant)."""
    if body.stream_options is not None and not body.stream:
        raise InvalidParameter("stream_options is only allowed with stream=true", param="stream_options")
    return SamplingParams(
        max_tokens=_max_tokens(max_tokens, default_max_tokens, tenant),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k is None else body.top_k,
        seed=body.seed,
        stop=body.stop_list,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
    )


def _max_tokens(asked: int | None, default: int, tenant: Tenant) -> int:
    cap = tenant.max_tokens
    if asked is None:
        return max(1, default if cap is None else min(default, cap))
    if cap is not None and asked > cap:
        raise InvalidParameter(f"max_tokens={asked} exceeds the limit of tenant '{tenant.name}', {cap}; "
                               f"ask for at most {cap} tokens", param="max_tokens")
    return asked
