"""Every message that crosses the frontend/engine process boundary, and nothing else.

Each message is a frozen msgspec Struct tagged with its class name. `ToEngineMsg` and
`FromEngineMsg` are the explicit registries the codec decodes into: a message not listed
there cannot be received. A new protocol step is a new message, never a flag on an old one.
Every request-scoped message names its tenant, so no role ever has to guess it.
"""

from __future__ import annotations

import msgspec


class _Msg(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    pass


class ReasoningGateMsg(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`kvseal.types.ReasoningGate`."""

    start_token_id: int
    end_token_id: int
    open_at_start: bool


class StructuredOutputMsg(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`kvseal.types.StructuredOutput`."""

    kind: str
    schema: str | None = None
    reasoning: ReasoningGateMsg | None = None


class SamplingParamsMsg(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`kvseal.types.SamplingParams`, field for field."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    min_tokens: int
    logprobs: int | None
    truncate_prompt_tokens: int | None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: list[tuple[int, float]] = []
    structured: StructuredOutputMsg | None = None
    min_p: float = 0.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    detokenize: bool = True
    allowed_token_ids: list[int] | None = None
    cache_salt: str | None = None


class RequestTimingMsg(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`kvseal.types.RequestTiming`: durations in seconds, each measured on one engine's own clock."""

    queue_s: float
    prefill_s: float
    decode_s: float


class TokenLogprobsMsg(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # the token's place among all tokens (1: the most likely)


# ---- frontend -> engine ---------------------------------------------------------------


class AddRequestMsg(_Msg, frozen=True):
    """Run an admitted request. The frontend already ran `admit` (I1); the engine re-checks.

    `tenant` is the authenticated tenant; the engine derives the prefix-cache namespace from it
    (I5), so no message can name another tenant's cache.
    """

    request_id: str
    tenant: str
    prompt_token_ids: list[int]
    params: SamplingParamsMsg


# Reasons the frontend gives in `AbortMsg` / `ShutdownMsg`; they come back in the output's `error`.
ABORT_CLIENT_DISCONNECTED = "client_disconnected"
ABORT_SERVER_SHUTDOWN = "server_shutdown"
# another choice of the request failed and its response ended with that error: the rest stop there
ABORT_CHOICE_FAILED = "another_choice_failed"
ABORT_KEY_REVOKED = "api_key_revoked"  # the operator removed or revoked the request's API key (abort=true)
ABORT_MODEL_DISABLED = "model_disabled"  # the operator disabled the model (abort=true)
# What clients are told when a tensor-parallel rank died or hung; the collective's own error (gloo's
# source paths, ports, PIDs) stays in the engine's log.
TP_RANK_LOST = "a tensor-parallel rank was lost; the engine stopped"


class AbortMsg(_Msg, frozen=True):
    """End a request now and free its pages. Ignored unless `tenant` owns `request_id`."""

    request_id: str
    tenant: str
    reason: str


class ForgetTenantMsg(_Msg, frozen=True):
    """Forget `tenant`'s prefix cache: the operator removed the name from the frontend's keys
    (a key added later under it may be another customer's) or asked for it
    (`POST /admin/tenants/{name}/forget-cache`). The engine frees every cached page of the name,
    in every namespace, now or as its last reader ends, scrubbed as evicted pages are (I7); its
    requests already here never read or publish a cached page again; its requests that arrive
    after this message are a new tenant's (`KVCacheManager.forget_tenant`).

    `request_ids`: requests of the tenant that the frontend started before and whose message may
    reach this engine only after this one (PD: reserved before, sent to prefill after); they are
    the old tenant's and are closed to the cache as those already here."""

    tenant: str
    request_ids: list[str] = []


class ShutdownMsg(_Msg, frozen=True):
    """Abort everything still running, report it, send `EngineStoppedMsg` and exit."""

    reason: str


# ---- engine -> frontend ---------------------------------------------------------------


class EngineReadyMsg(_Msg, frozen=True):
    """Sent once, when the engine has loaded the model and can take requests.

    The frontend admits requests (I1) with exactly these limits and loads the tokenizer
    from `tokenizer_path`.
    """

    pid: int
    model_name: str
    model_path: str
    tokenizer_path: str
    architecture: str
    max_model_len: int
    kv_cache_tokens: int
    vocab_size: int
    page_size: int
    num_pages: int
    kv_scrub_policy: str  # `CacheConfig.scrub_policy`: off, free, alloc or checked (I7, for /metrics)


class EngineFailedMsg(_Msg, frozen=True):
    """The engine cannot start or cannot go on; the process exits after sending it."""

    error_type: str
    message: str


class EngineStoppedMsg(_Msg, frozen=True):
    """Reply to `ShutdownMsg`: every request has been reported; the process now exits."""

    num_aborted: int


class RequestRejectedMsg(_Msg, frozen=True):
    """The engine's own admission re-check refused the request; nothing was queued."""

    request_id: str
    tenant: str
    code: str
    message: str
    param: str | None
    http_status: int


class RequestOutputMsg(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one step produced for one request (increments only).

    A finished output with `finish_reason == "abort"` carries the reason in `error`; it is
    an error, never a success. `num_pages_reserved` is the most KV pages the request has
    held so far; `num_kv_tokens_written`, on the finished output, the KV slots written for it
    (both for the audit record, I8).
    """

    request_id: str
    tenant: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_pages_reserved: int
    num_kv_tokens_written: int = 0
    logprobs: list[TokenLogprobsMsg] | None = None
    error: str | None = None
    error_code: str | None = None  # e.g. "isolation_check_failed" (kvseal.types.ISOLATION_CHECK_FAILED)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage.prompt_tokens_details)
    # `SamplingParams.prompt_logprobs`: one entry per prompt token (None first), sent once, with
    # the first output token
    prompt_logprobs: list[TokenLogprobsMsg | None] | None = None
    # on the finished output of a request that had a first token: its phases (for /metrics)
    timing: RequestTimingMsg | None = None


class OutputsMsg(_Msg, frozen=True):
    """The outputs of one engine loop iteration, in step order."""

    outputs: list[RequestOutputMsg]


class EngineStatsMsg(_Msg, frozen=True):
    """Engine load after an iteration that changed something (for /metrics)."""

    num_running: int
    num_waiting: int
    num_pages_used: int
    num_pages_free: int
    num_preemptions: int
    num_isolation_violations: int = 0  # requests an isolation check (I3/I4) ended
    num_pages_scrubbed: int = 0  # pages the scrub policy (I7) overwrote since the engine started
    # structured-output grammar compiles (kvseal.structured.compiler.GrammarPoolStats)
    num_grammar_workers_ready: int = 0
    num_grammar_compiles_running: int = 0
    num_grammar_compiles_queued: int = 0
    num_grammar_compile_timeouts: int = 0  # stopped at the time budget since the engine started
    num_grammar_compiles_cancelled: int = 0  # stopped or dropped: every waiting request left
    # The frontend's total: preemptions of every engine instance it saw, since it started (never
    # goes back when one restarts, as `num_preemptions` does); None as an engine sends it.
    num_preemptions_total: int | None = None


class EngineAliveMsg(_Msg, frozen=True):
    """The engine process is running: sent every `kvseal.engine.process.HEARTBEAT_S` by a thread of its own, whatever
    the loop is doing (a frontend that hears nothing for `--engine-timeout-s` kills it)."""


ToEngineMsg = AddRequestMsg | AbortMsg | ForgetTenantMsg | ShutdownMsg
FromEngineMsg = (
    EngineReadyMsg | EngineFailedMsg | EngineStoppedMsg | RequestRejectedMsg | OutputsMsg | EngineStatsMsg
    | EngineAliveMsg
)
