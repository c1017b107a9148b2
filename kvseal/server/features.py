"""Which optional features a request used, by name, for the audit log (I8). Never their content."""

from __future__ import annotations

from pydantic import BaseModel

# Request fields whose presence the audit log records (a field sent at all counts as used).
FEATURE_FIELDS = (
    "n", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "stop", "stop_token_ids",
    "seed", "logprobs", "top_logprobs", "min_tokens", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
    "truncate_prompt_tokens", "response_format", "tools", "tool_choice", "stream", "echo", "prompt_logprobs",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "allowed_token_ids",
    "include_reasoning", "add_special_tokens", "cache_salt", "best_of", "parallel_tool_calls", "store", "metadata",
)


def features_used(body: BaseModel) -> list[str]:
    """The names of the feature fields `body` set explicitly, in `FEATURE_FIELDS` order."""
    sent = body.model_fields_set
    return [name for name in FEATURE_FIELDS if name in sent]
