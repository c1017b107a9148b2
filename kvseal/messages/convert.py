"""Between messages and the engine's vocabulary (`kvseal.types`). Pure functions."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvseal.messages.msgs import (
    EngineStatsMsg,
    ReasoningGateMsg,
    RequestOutputMsg,
    RequestTimingMsg,
    SamplingParamsMsg,
    StructuredOutputMsg,
    TokenLogprobsMsg,
)
from kvseal.types import (
    ReasoningGate,
    RequestOutput,
    RequestTiming,
    SamplingParams,
    StructuredOutput,
    TokenLogprobs,
)

if TYPE_CHECKING:  # the engine module loads torch and the models; this one stays light
    from kvseal.engine.engine import EngineStats


def params_to_msg(params: SamplingParams) -> SamplingParamsMsg:
    assert params.max_tokens is not None, "a frontend resolves max_tokens before it sends a request"
    return SamplingParamsMsg(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        seed=params.seed, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos, min_tokens=params.min_tokens, logprobs=params.logprobs,
        truncate_prompt_tokens=params.truncate_prompt_tokens, n=params.n,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, logit_bias=list(params.logit_bias),
        structured=None if params.structured is None else structured_to_msg(params.structured),
        min_p=params.min_p, include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens, prompt_logprobs=params.prompt_logprobs,
        detokenize=params.detokenize,
        allowed_token_ids=None if params.allowed_token_ids is None else list(params.allowed_token_ids),
        cache_salt=params.cache_salt,
    )


def params_from_msg(msg: SamplingParamsMsg) -> SamplingParams:
    """Raises `InvalidParameter` for values SamplingParams refuses (validated again here)."""
    return SamplingParams(
        max_tokens=msg.max_tokens, temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k,
        seed=msg.seed, stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos, min_tokens=msg.min_tokens, logprobs=msg.logprobs,
        truncate_prompt_tokens=msg.truncate_prompt_tokens, n=msg.n,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty, logit_bias=tuple(msg.logit_bias),
        structured=None if msg.structured is None else structured_from_msg(msg.structured),
        min_p=msg.min_p, include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=msg.skip_special_tokens, prompt_logprobs=msg.prompt_logprobs,
        detokenize=msg.detokenize,
        allowed_token_ids=None if msg.allowed_token_ids is None else tuple(msg.allowed_token_ids),
        cache_salt=msg.cache_salt,
    )


def structured_to_msg(structured: StructuredOutput) -> StructuredOutputMsg:
    gate = structured.reasoning
    return StructuredOutputMsg(structured.kind, structured.schema, None if gate is None else ReasoningGateMsg(
        gate.start_token_id, gate.end_token_id, gate.open_at_start))


def structured_from_msg(msg: StructuredOutputMsg) -> StructuredOutput:
    gate = msg.reasoning
    return StructuredOutput(msg.kind, msg.schema, None if gate is None else ReasoningGate(
        gate.start_token_id, gate.end_token_id, gate.open_at_start))


def logprobs_to_msg(lp: TokenLogprobs) -> TokenLogprobsMsg:
    return TokenLogprobsMsg(lp.token_id, lp.logprob, list(lp.top), lp.rank)


def logprobs_from_msg(msg: TokenLogprobsMsg) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, tuple(msg.top), msg.rank)


def prompt_logprobs_to_msg(lps: list[TokenLogprobs | None] | None) -> list[TokenLogprobsMsg | None] | None:
    return None if lps is None else [None if lp is None else logprobs_to_msg(lp) for lp in lps]


def timing_to_msg(timing: RequestTiming | None) -> RequestTimingMsg | None:
    return None if timing is None else RequestTimingMsg(timing.queue_s, timing.prefill_s, timing.decode_s)


def timing_from_msg(msg: RequestTimingMsg | None) -> RequestTiming | None:
    return None if msg is None else RequestTiming(msg.queue_s, msg.prefill_s, msg.decode_s)


def output_to_msg(out: RequestOutput) -> RequestOutputMsg:
    """Only the increment: `new_token_ids`, `new_text` and the logprobs of the new tokens (the
    prompt's logprobs with the first token)."""
    logprobs = None
    first_new = len(out.token_ids) - len(out.new_token_ids)
    if out.logprobs is not None:
        logprobs = [logprobs_to_msg(lp) for lp in out.logprobs[first_new:]]
    prompt_logprobs = None
    if out.prompt_token_logprobs is not None and first_new == 0 and out.new_token_ids:
        prompt_logprobs = prompt_logprobs_to_msg(out.prompt_token_logprobs)
    return RequestOutputMsg(
        request_id=out.request_id, tenant=out.tenant, new_token_ids=list(out.new_token_ids),
        new_text=out.new_text, finished=out.finished,
        finish_reason=out.finish_reason.value if out.finish_reason is not None else None,
        stop_reason=out.stop_reason, num_prompt_tokens=out.num_prompt_tokens,
        num_output_tokens=len(out.token_ids), num_pages_reserved=out.num_pages_reserved,
        num_kv_tokens_written=out.num_kv_tokens_written, num_cached_tokens=out.num_cached_tokens,
        logprobs=logprobs, error=out.error, error_code=out.error_code, prompt_logprobs=prompt_logprobs,
        timing=timing_to_msg(out.timing),
    )


def stats_to_msg(s: EngineStats) -> EngineStatsMsg:
    """Every engine role reports its stats in this one shape (colocated and PD alike)."""
    return EngineStatsMsg(
        num_running=s.num_running, num_waiting=s.num_waiting, num_pages_used=s.num_pages_used,
        num_pages_free=s.num_pages_free, num_preemptions=s.num_preemptions,
        num_isolation_violations=s.num_isolation_violations, num_pages_scrubbed=s.num_pages_scrubbed,
        num_grammar_workers_ready=s.grammar.num_workers_ready, num_grammar_compiles_running=s.grammar.num_running,
        num_grammar_compiles_queued=s.grammar.num_queued, num_grammar_compile_timeouts=s.grammar.num_timeouts,
        num_grammar_compiles_cancelled=s.grammar.num_cancelled,
    )
