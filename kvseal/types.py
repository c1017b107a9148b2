"""The vocabulary: the names every other module uses for requests, parameters and batches."""

from __future__ import annotations

import enum
import hashlib
import json as _json
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvseal.errors import InvalidParameter

if TYPE_CHECKING:  # the vocabulary stays importable without torch (the frontend, canary, bench)
    import torch

DEFAULT_TENANT = "default"
# `RequestOutput.error_code` of a request ended because an isolation check tripped (I3/I4).
ISOLATION_CHECK_FAILED = "isolation_check_failed"
# `RequestOutput.error_code` (and a PD refusal's code) of a request its engine could not finish because
# the engine itself was lost (a tensor-parallel rank died or hung): the client gets 503, as for a dead
# engine process, and the audit says error, never a rejection of the request.
ENGINE_UNAVAILABLE = "engine_unavailable"
# `RequestOutput.error_code` of a PD request whose KV handoff failed on decode (its reservation saw no
# sign of prefill within `--reservation-timeout-s`, or was released without a commit): the server's
# failure, not the client's; the client gets 503 and the audit says error with this reason.
HANDOFF_FAILED = "kv_handoff_failed"
# `RequestOutput.error_code` of a request ended because its grammar (with its `allowed_token_ids`,
# or alone, where the vocabulary cannot continue it) left no token to sample at some step: it ends
# there, without a token outside either. The error says which (`NO_TOKEN_LEFT_*`).
NO_TOKEN_SATISFIES_CONSTRAINTS = "no_token_satisfies_constraints"
NO_TOKEN_LEFT_BOTH = ("no token satisfies both the request's allowed_token_ids and its structured-output grammar at "
                      "this step; the request ended without sampling one. Allow tokens the grammar can take next, or "
                      "drop one of the two constraints")
NO_TOKEN_LEFT_GRAMMAR = ("no token of this model's vocabulary can continue the request's structured-output grammar at "
                         "this step; the request ended without sampling one. The grammar asks for text this model's "
                         "tokens cannot spell (its tokenizer has no token for some characters it requires)")


def no_token_param(error: str | None) -> str | None:
    """The request field a `no_token_satisfies_constraints` error names: `allowed_token_ids`
    where it and the grammar shared no token; none where the grammar alone could not be continued
    (it may come from response_format, tools or a guided field)."""
    return None if error == NO_TOKEN_LEFT_GRAMMAR else "allowed_token_ids"


SAMPLING_EPS = 1e-5
MAX_N = 16  # most choices one request may ask for


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded `seed` (served and offline alike): seed +
    index, so the request is reproducible and its choices differ; unseeded stays unseeded."""
    return None if seed is None else (seed + index) % 2**63
_INT_FIELDS = ("top_k", "min_tokens", "n")
_OPTIONAL_INT_FIELDS = ("max_tokens", "seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
MAX_CACHE_SALT_CHARS = 256
MAX_LOGPROBS = 20  # most alternatives a position's logprobs may carry (vLLM's default max_logprobs)
_REAL_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def namespace_of(tenant: str, cache_salt: str | None = None, cache_epoch: int = 0) -> str:
    """The prefix-cache namespace of a tenant (I5): a framed hash over the tenant id, and the
    request's `cache_salt` when it has one (vLLM's: a tenant's way to split its own cache, e.g.
    one namespace per end user), the only way a namespace is made. Engines derive it from the
    request's tenant and salt themselves; no message and no caller carries one. A salt only
    divides its tenant's namespace: no salt makes another tenant's.

    `cache_epoch`: how many times the engine had been told to forget the tenant's cache when the
    request reached it (`KVCacheManager.forget_tenant`): a tenant name removed and added again is
    a new namespace, so nothing the old one cached can be a hit for the new one (0: never)."""
    framed = b"kvseal-prefix-namespace\x00" + len(tenant).to_bytes(8, "big") + tenant.encode()
    if cache_salt is not None:
        salt = cache_salt.encode()
        framed += b"\x01salt" + len(salt).to_bytes(8, "big") + salt
    if cache_epoch:
        framed += b"\x02epoch" + cache_epoch.to_bytes(8, "big")
    return hashlib.sha256(framed).hexdigest()


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # ended early; never reported to a client as a success


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


STRUCTURED_KINDS = ("json_object", "json_schema", "tool_call", "tool_calls", "qwen3_coder_call", "regex", "choice",
                    "grammar")


@dataclass(frozen=True)
class ReasoningGate:
    """Where a thinking model's grammar begins: after its reasoning block (vLLM's behaviour with
    a reasoning parser). The block is open from the first token when `open_at_start` (the prompt
    left a `<think>` open); otherwise the first token may open it (`start_token_id`) or begin the
    answer. While the block is open nothing is masked; the grammar takes over after
    `end_token_id`."""

    start_token_id: int
    end_token_id: int
    open_at_start: bool

    def __post_init__(self) -> None:
        ids = (self.start_token_id, self.end_token_id)
        _require(all(_is_int(t) and t >= 0 for t in ids) and ids[0] != ids[1], "reasoning",
                 f"the reasoning markers must be two different token ids, got {ids}")
        _require(isinstance(self.open_at_start, bool), "reasoning", "open_at_start must be a bool")


@dataclass(frozen=True)
class StructuredOutput:
    """Output constrained by a grammar while sampling: any JSON object, JSON matching `schema`
    (a JSON Schema, as JSON text), one Hermes tool call `<tool_call>\n{json}\n</tool_call>` whose
    JSON matches `schema` (`tool_calls`: one or more, a newline between), one Qwen3-Coder XML
    call to one of the tools of `schema` (a JSON list of `{"name", "parameters"}`), text matching
    a regular expression (`schema` is the regex), one of several strings (`schema` is their JSON
    list), or text an EBNF grammar derives (`schema` is the grammar, in xgrammar's EBNF).
    Compiled with xgrammar (kvseal.structured). With `reasoning`, the grammar constrains only
    what follows the reasoning block."""

    kind: str  # one of STRUCTURED_KINDS
    schema: str | None = None  # the spec's text (None for json_object)
    reasoning: ReasoningGate | None = None

    def __post_init__(self) -> None:
        _require(self.kind in STRUCTURED_KINDS, "response_format",
                 f"kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        _require((self.schema is not None) == (self.kind != "json_object"), "response_format",
                 f"a {self.kind} grammar needs its spec" if self.kind != "json_object"
                 else "json_object takes no schema")
        _require(self.reasoning is None or isinstance(self.reasoning, ReasoningGate), "reasoning",
                 "must be a ReasoningGate")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured-output spec for one request (`SamplingParams(structured_outputs=...)`;
    `GuidedDecodingParams` and `guided_decoding=` are its older names): exactly one of a JSON
    Schema (`json`, a dict or JSON text), any JSON object (`json_object=True`), a regular
    expression (`regex`), a list of strings to choose one of (`choice`), or an EBNF grammar
    (`grammar`, xgrammar's dialect)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def as_structured(self, param: str = "structured_outputs") -> StructuredOutput:
        specs: dict[str, Any] = {name: value for name, value in (("json", self.json), ("regex", self.regex),
                                                                 ("choice", self.choice), ("grammar", self.grammar))
                                 if value is not None}
        if self.json_object:
            specs["json_object"] = True
        _require(len(specs) == 1, param, f"give exactly one of json, regex, choice, grammar or json_object=True; "
                                         f"got {sorted(specs) or 'none'}")
        [(name, value)] = specs.items()
        if name == "json_object":
            return StructuredOutput("json_object")
        if name == "json":
            _require(isinstance(value, str | dict), param, "json must be a JSON Schema: a dict or JSON text")
            if isinstance(value, str):
                return StructuredOutput("json_schema", value)
            try:
                return StructuredOutput("json_schema", _json.dumps(value))
            except (TypeError, ValueError, RecursionError) as exc:  # a set, bytes, a circular dict ...
                raise InvalidParameter(f"invalid {param}: json must be a JSON Schema; this dict is not JSON ({exc})",
                                       param=param) from None
        if name == "choice":
            _require(isinstance(value, list | tuple) and len(value) > 0
                     and all(isinstance(c, str) and c for c in value), param,
                     "choice must be a non-empty list of non-empty strings")
            return StructuredOutput("choice", _json.dumps(list(value), ensure_ascii=False))
        _require(isinstance(value, str) and value != "", param, f"{name} must be a non-empty string")
        return StructuredOutput(name, value)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's earlier name


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of generation. Every field is honoured or rejected, never ignored.

    temperature 0 means greedy. top_k <= 0, top_p == 1 and min_p == 0 disable those filters
    (min_p, as vLLM's: drop the tokens less likely than min_p times the most likely one). A seed
    makes sampling reproducible for this request regardless of what it is batched with (-1, as
    in vLLM, is no seed).
    presence/frequency penalties follow OpenAI (output tokens only), repetition_penalty
    follows vLLM/transformers (prompt and output tokens); `logit_bias` is (token id, bias)
    pairs added to the logits. `n` choices are generated from one prompt.

    `prompt_logprobs` (vLLM's): the log-probability of every prompt token after the first, with
    that many alternatives per position (0: the prompt token's alone), from the model's raw
    logits (no bias, penalty or temperature: they shape sampling, not the prompt). A request
    asking for them computes its whole prompt itself (it reads no prefix-cache page).
    """

    max_tokens: int | None = 16  # None: the rest of the context (resolved when the engine admits it)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None
    min_p: float = 0.0
    include_stop_str_in_output: bool = False  # vLLM's: keep the matched stop string in the text
    skip_special_tokens: bool = True  # vLLM's: False puts special tokens (e.g. </s>) in the text
    detokenize: bool = True  # vLLM's: False returns token ids only (no text, no time spent decoding)
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: sample only these tokens
    prompt_logprobs: int | None = None
    # vLLM's: the request's prefix-cache namespace is its tenant's and this salt's (namespace_of)
    cache_salt: str | None = None
    # vLLM's ways to ask for `structured` (either, not both; they fill it in)
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._check_types()
        self._resolve_structured()
        _require(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
                 f"must be >= 1 (or None for the rest of the context), got {self.max_tokens}")
        _require(math.isfinite(self.temperature) and self.temperature >= 0, "temperature",
                 f"must be a finite number >= 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= -1, "top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        _require(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1] (0 is off), got {self.min_p}")
        _require(0 <= self.min_tokens <= (math.inf if self.max_tokens is None else self.max_tokens), "min_tokens",
                 f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop",
                 "every stop sequence must be a non-empty string")
        _require(self.detokenize or not self.stop, "detokenize",
                 "stop strings are matched in the output text, which detokenize=False does not make; use "
                 "stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or 0 <= value <= MAX_LOGPROBS, name,
                     f"must be between 0 and {MAX_LOGPROBS}, got {value}")
        _require(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1
                 or self.truncate_prompt_tokens >= 1, "truncate_prompt_tokens",
                 f"must be >= 1, or -1 for the most a prompt may have, got {self.truncate_prompt_tokens}")
        self._check_penalties()
        _require(self.cache_salt is None or (isinstance(self.cache_salt, str) and
                                             1 <= len(self.cache_salt) <= MAX_CACHE_SALT_CHARS), "cache_salt",
                 f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, got {self.cache_salt!r}")

    def _check_types(self) -> None:
        """Refuse values of the wrong type before they reach the sampler (where a float `top_k`
        or `logprobs` would fail mid-step), and normalize the sequences to tuples."""
        for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_INT_FIELDS:
                continue
            _require(_is_int(value), name, f"must be an integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        for name in _REAL_FIELDS:
            value = getattr(self, name)
            _require(isinstance(value, numbers.Real) and not isinstance(value, bool), name,
                     f"must be a number, got {value!r}")
            object.__setattr__(self, name, float(value))
        _require(self.seed is None or -2**63 <= self.seed < 2**63, "seed",
                 f"must fit in 64 bits ([-2**63, 2**63)), got {self.seed}")
        if self.seed == -1:  # vLLM's: no seed
            object.__setattr__(self, "seed", None)
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", f"must be true or false, got {self.ignore_eos!r}")
        for flag in ("include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            _require(isinstance(getattr(self, flag), bool), flag, f"must be true or false, got {getattr(self, flag)!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        object.__setattr__(self, "stop", _as_tuple(stop, "stop", "a string or a list of strings"))
        stop_token_ids = _as_tuple(self.stop_token_ids, "stop_token_ids", "a list of token ids")
        _require(all(_is_int(t) for t in stop_token_ids), "stop_token_ids", "every token id must be an integer")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = _as_tuple(self.allowed_token_ids, "allowed_token_ids", "a list of token ids")
            _require(len(allowed) > 0 and all(_is_int(t) and t >= 0 for t in allowed), "allowed_token_ids",
                     "must be a non-empty list of token ids (integers >= 0)")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted({int(t) for t in allowed})))

    def _resolve_structured(self) -> None:
        """vLLM's `structured_outputs` / `guided_decoding` -> `structured` (a spec given twice,
        differently, is refused)."""
        given = [(name, spec) for name in ("structured_outputs", "guided_decoding")
                 if (spec := getattr(self, name)) is not None]
        _require(self.structured is None or isinstance(self.structured, StructuredOutput), "structured",
                 f"must be a StructuredOutput (or give structured_outputs=StructuredOutputsParams(...)), got "
                 f"{type(self.structured).__name__}")
        if not given:
            return
        _require(len(given) == 1, "structured_outputs", "give structured_outputs or guided_decoding, not both")
        [(name, spec)] = given
        _require(isinstance(spec, StructuredOutputsParams), name,
                 f"must be a StructuredOutputsParams (GuidedDecodingParams), got {type(spec).__name__}")
        structured = spec.as_structured(name)
        _require(self.structured is None or self.structured == structured, name,
                 f"{name} and structured ask for different grammars")
        object.__setattr__(self, "structured", structured)

    def _check_penalties(self) -> None:
        _require(1 <= self.n <= MAX_N, "n", f"must be between 1 and {MAX_N}, got {self.n}")
        for name, value in (("presence_penalty", self.presence_penalty),
                            ("frequency_penalty", self.frequency_penalty)):
            _require(-2 <= value <= 2, name, f"must be between -2 and 2, got {value}")
        _require(0 < self.repetition_penalty <= 10, "repetition_penalty",
                 f"must be in (0, 10], got {self.repetition_penalty}")
        _require(all(-100 <= b <= 100 for _, b in self.logit_bias), "logit_bias",
                 "every bias must be between -100 and 100")
        _require(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "token ids must be >= 0")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def is_greedy(self) -> bool:
        """Temperatures below 1e-5 sample greedily: dividing logits by them overflows float32."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(f"invalid {param}: {message}", param=param)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _as_tuple(value: object, param: str, expected: str) -> tuple[Any, ...]:
    _require(isinstance(value, (list, tuple)), param, f"must be {expected}, got {value!r}")
    return tuple(value)  # type: ignore[arg-type]


def _logit_bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """{token id: bias} or (token id, bias) pairs -> (int, float) pairs."""
    pairs = _as_tuple(list(bias.items()) if isinstance(bias, dict) else bias, "logit_bias",
                      "a {token id: bias} mapping")
    _require(all(isinstance(p, tuple | list) and len(p) == 2 and _is_int(p[0]) and isinstance(p[1], numbers.Real)
                 and not isinstance(p[1], bool) for p in pairs),
             "logit_bias", "every entry must map an integer token id to a number")
    return tuple((int(t), float(b)) for t, b in pairs)


@dataclass(frozen=True)
class RequestTiming:
    """How long a request spent in each phase, measured by the engines on their own monotonic
    clocks (durations only, never timestamps: no clock is compared across processes).

    `queue_s`: from the engine queueing it to its first schedule; `prefill_s`: from there to its
    first token; `decode_s`: from its first token to its last. A preemption keeps the first
    schedule and the first token (vLLM's): the time it waits and recomputes after one counts in
    prefill or decode, not in the queue. PD: prefill measures the first two, decode the third,
    from its taking the handoff over; the KV transfer between them is in none.
    """

    queue_s: float
    prefill_s: float
    decode_s: float

    @property
    def inference_s(self) -> float:
        """From the first schedule to the last token (vLLM's RUNNING phase)."""
        return self.prefill_s + self.decode_s


@dataclass
class Request:
    """One admitted request as the engine sees it. Owned by exactly one scheduler queue.

    `num_computed_tokens` counts tokens whose KV is in the pages it holds: its own, written by
    a forward of it, or shared prefix-cache pages of its namespace; it is reset to 0 on
    preemption. `num_cached_tokens` is how many prompt tokens its first schedule found in
    the prefix cache (usage, I8); `page_hashes` the chained hashes of its full pages so far.
    `cache_namespace` is derived from `tenant` (I5) and `cache_epoch` (the tenant's cache epoch on
    this engine when the request reached it, `KVCacheManager.cache_epoch`) and cannot be given.
    """

    request_id: str
    tenant: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_namespace: str = field(init=False)
    num_cached_tokens: int = 0
    page_hashes: list[bytes] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # with `params.prompt_logprobs`: one entry per prompt position computed so far, None first
    # (the first token has no context to be predicted from); None otherwise
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    max_num_pages: int = 0  # most KV pages held at once (audit, I8)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    grammar: Any = None  # a `structured.matching.RequestGrammar` when params.structured is set
    # this engine's monotonic clock: queued here, first scheduled (kept across preemptions),
    # first and latest token sampled (or, PD decode, taken over with its first token)
    arrival_s: float = field(default_factory=time.monotonic)
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    # PD decode: the queue and prefill durations prefill measured (`RequestTiming.decode_s` unused)
    prefilled_timing: RequestTiming | None = None
    cache_epoch: int = 0

    def __post_init__(self) -> None:
        self.cache_namespace = namespace_of(self.tenant, self.params.cache_salt, self.cache_epoch)
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt positions are still without their logprobs: until they all have them,
        the request computes its prompt itself (`KVCacheManager.match_prefix` finds nothing)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def note_token(self) -> None:
        """A token was sampled for it now (or, PD decode, its first token taken over)."""
        self.last_token_s = time.monotonic()
        if self.first_token_s is None:
            self.first_token_s = self.last_token_s

    def timing(self) -> RequestTiming | None:
        """Its phases so far; None before its first token, or for one no scheduler ran (its
        tokens fed by hand: the figures are for /metrics, never worth failing a request over)."""
        if self.first_token_s is None or self.last_token_s is None:
            return None
        decode_s = self.last_token_s - self.first_token_s
        if self.prefilled_timing is not None:
            return RequestTiming(self.prefilled_timing.queue_s, self.prefilled_timing.prefill_s, decode_s)
        if self.first_scheduled_s is None:
            return None
        return RequestTiming(self.first_scheduled_s - self.arrival_s, self.first_token_s - self.first_scheduled_s,
                             decode_s)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of a token (sampled, or a prompt token) and of the most likely
    alternatives; `rank` is the token's place among all tokens (1: the most likely), None where
    it was not computed."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class Logprob:
    """One token's entry in a position's logprobs, in vLLM's shape: `rank` 1 is the most likely
    token (None where it was not computed)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class CompletionOutput:
    """One choice of an offline request, in vLLM's shape (`RequestOutput.outputs[index]`).
    `cumulative_logprob` is the sum of the sampled tokens' logprobs, None unless the request
    asked for logprobs; `logprobs` has one dict per output token, as vLLM's: token id -> `Logprob`,
    the sampled token first, then the top `SamplingParams.logprobs` tokens."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None


@dataclass(frozen=True)
class RequestOutput:
    """What one step (or a whole offline generate) reports for one request.

    `new_token_ids` and `new_text` are the increment since the previous report; `token_ids`
    and `text` the whole output so far. `text` never contains a matched stop string.
    `num_pages_reserved` is the most KV pages the request has held so far;
    `num_kv_tokens_written` (set when finished) how many KV slots were written for it in the
    pages it held at the end.

    `prompt_token_logprobs` (a request with `SamplingParams.prompt_logprobs`, from its first
    token on) has one entry per prompt token, None for the first. `timing` (set when finished,
    for a request that had a first token) says how long it queued, prefilled and decoded.

    The offline API (`LLM.generate`) also sets `prompt` (the text prompt, None for token ids),
    `prompt_logprobs` (vLLM's shape of `prompt_token_logprobs`) and `outputs`, every choice of
    the request (`SamplingParams.n` of them) in vLLM's shape; the other fields are choice 0's.
    Outputs of engine steps leave `outputs` empty and `prompt_logprobs` None.
    """

    request_id: str
    tenant: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    error_code: str | None = None  # machine-readable cause of an abort, e.g. ISOLATION_CHECK_FAILED
    num_pages_reserved: int = 0
    num_kv_tokens_written: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_token_logprobs: list[TokenLogprobs | None] | None = None
    timing: RequestTiming | None = None  # set when finished, for a request that had a first token
    prompt: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def as_completion(self, index: int, decode: Callable[[int], str | None]) -> CompletionOutput:
        """This output as choice `index`; `decode` gives a token id's text (`decoded_token`)."""
        if self.logprobs is None:
            return CompletionOutput(index, self.text, self.token_ids, None, None, self.finish_reason, self.stop_reason)
        cumulative = sum(lp.logprob for lp in self.logprobs)
        logprobs = [vllm_logprobs(lp, decode) for lp in self.logprobs]
        return CompletionOutput(index, self.text, self.token_ids, cumulative, logprobs, self.finish_reason,
                                self.stop_reason)

    def vllm_prompt_logprobs(self, decode: Callable[[int], str | None]) -> list[dict[int, Logprob] | None] | None:
        """`prompt_token_logprobs` in vLLM's shape (None where the request did not ask for them)."""
        if self.prompt_token_logprobs is None:
            return None
        return [None if lp is None else vllm_logprobs(lp, decode) for lp in self.prompt_token_logprobs]


def vllm_logprobs(lp: TokenLogprobs, decode: Callable[[int], str | None]) -> dict[int, Logprob]:
    """One position in vLLM's shape: the position's own token first (with its rank among all
    tokens), then the top alternatives, ranked 1..k."""
    top = {token: Logprob(value, rank, decode(token)) for rank, (token, value) in enumerate(lp.top, start=1)}
    own = top.pop(lp.token_id, None) or Logprob(lp.logprob, lp.rank, decode(lp.token_id))
    return {lp.token_id: own, **top}


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_new_tokens` tokens of `request`, starting at its `num_computed_tokens`."""

    request: Request
    num_new_tokens: int

    @property
    def start_pos(self) -> int:
        return self.request.num_computed_tokens

    @property
    def is_last_chunk(self) -> bool:
        """True when this chunk reaches the request's last token, so it yields a sample."""
        return self.start_pos + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class ForwardBatch:
    """Everything the model runner needs for one forward; it sees nothing else.

    Tokens of all sequences are flattened. Sequence i owns the next query_len[i] tokens, at
    positions [context_len[i] - query_len[i], context_len[i]), and attends to the first
    context_len[i] slots of the pages in `block_tables[i]` (pages it owns, in position
    order). `logits_indices` picks the tokens to sample from.
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64: pool slot each new token's KV goes to
    query_lens: list[int]
    context_lens: list[int]
    # per sequence: [ceil(context_len / page_size)] int64 page ids, on the host (the tensors
    # above are on the pool's device)
    block_tables: list[torch.Tensor]
    logits_indices: torch.Tensor  # [num_samples] int64 into the flattened tokens

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
