"""Decode's verification of a commit, before it schedules a single step (I4; docs/ARCHITECTURE.md,
"The handoff, as implemented").

A commit is accepted only if, word for word: it names a live reservation's transfer id; its
request id and tenant are the reservation's; its token count is the prompt length; its first
token is in the vocabulary (and among the request's allowed_token_ids, where it has them); its
logprobs are there exactly when the request asked for them, for that token, with as many
alternatives as asked, all in the vocabulary and none above 0; its prompt logprobs are there
exactly when the request asked for them, one per prompt token (None for the first), each of
that prompt token, with a rank in the vocabulary and as many alternatives as asked, checked as
the first token's; its generator state is a CPU generator's state, of exactly that size, that
the generator takes; and for every layer, for K and for V, the receiver's own landing records
cover every prompt position from the end of decode's prefix-cache hit on, nothing landed before
it (those are read-only cached pages), and the records say exactly what the commit claims.
Anything else is refused with a reason (a metrics label) and a message for the client and the
log. Nothing of a commit is used before it passed: a peer's bad word ends its own transfer,
never decode's loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvseal.disagg.msgs import CommitMsg, KVKind
from kvseal.disagg.transport import KINDS, Landing
from kvseal.messages.msgs import TokenLogprobsMsg

# What prefill sends (`torch.Generator.get_state()` of a request's CPU generator): its size never varies.
GENERATOR_STATE_BYTES = torch.Generator().get_state().numel()


@dataclass(frozen=True)
class Refusal:
    reason: str  # short label: metrics and audit
    message: str


@dataclass(frozen=True)
class Expected:
    """What decode reserved: the facts a commit is checked against."""

    transfer_id: str
    request_id: str
    tenant: str
    num_prompt_tokens: int
    num_layers: int
    vocab_size: int
    num_logprobs: int | None  # the request's `SamplingParams.logprobs`: alternatives the first token carries
    num_cached_tokens: int = 0  # decode's prefix-cache hit: the transfer covers [this, num_prompt_tokens)
    num_prompt_logprobs: int | None = None  # the request's `SamplingParams.prompt_logprobs`
    prompt_token_ids: tuple[int, ...] = ()  # the prompt decode reserved for (checked against prompt logprobs)
    allowed_token_ids: tuple[int, ...] | None = None  # the request's: the first token must be one of them


def verify_commit(expected: Expected, commit: CommitMsg, landing: Landing | None) -> Refusal | None:
    """None when the handoff may run; otherwise why not."""
    if commit.transfer_id != expected.transfer_id or landing is None:
        return Refusal("unknown_transfer", f"commit names transfer {commit.transfer_id}, which decode never "
                                           f"reserved or already released")
    if commit.request_id != expected.request_id or commit.tenant != expected.tenant:
        return Refusal("identity_mismatch", f"commit for request {commit.request_id} of tenant {commit.tenant!r} "
                                            f"does not match the reservation ({expected.request_id}, "
                                            f"{expected.tenant!r})")
    if commit.num_tokens != expected.num_prompt_tokens:
        return Refusal("token_count_mismatch", f"commit names {commit.num_tokens} tokens; the prompt has "
                                               f"{expected.num_prompt_tokens}")
    return _check_sample(expected, commit) or _check_coverage(expected, commit, landing)


def _check_sample(expected: Expected, commit: CommitMsg) -> Refusal | None:
    """What prefill sampled: the first token, its logprobs and the generator after it."""
    if not 0 <= commit.first_token < expected.vocab_size:
        return Refusal("bad_first_token", f"the first token {commit.first_token} is outside the vocabulary "
                                          f"[0, {expected.vocab_size})")
    if expected.allowed_token_ids is not None and commit.first_token not in expected.allowed_token_ids:
        return Refusal("bad_first_token", f"the first token {commit.first_token} is not one of the request's "
                                          f"allowed_token_ids")
    why = _logprobs_problem(expected, commit.first_token, commit.first_logprobs)
    if why is not None:
        return Refusal("bad_logprobs", why)
    why = _prompt_logprobs_problem(expected, commit.prompt_logprobs)
    if why is not None:
        return Refusal("bad_prompt_logprobs", why)
    if not is_generator_state(commit.generator_state):
        return Refusal("bad_generator_state", f"the generator state ({len(commit.generator_state)} bytes) is not "
                                              f"a CPU generator's state of {GENERATOR_STATE_BYTES} bytes")
    return None


def _logprobs_problem(expected: Expected, first_token: int, logprobs: TokenLogprobsMsg | None) -> str | None:
    if (logprobs is None) != (expected.num_logprobs is None):
        has = "lacks" if logprobs is None else "carries"
        return f"the request asked for logprobs={expected.num_logprobs}; the commit {has} them"
    if logprobs is None or expected.num_logprobs is None:
        return None
    return _position_problem(expected, first_token, logprobs, expected.num_logprobs, "the first token")


def _prompt_logprobs_problem(expected: Expected, logprobs: list[TokenLogprobsMsg | None] | None) -> str | None:
    wanted = expected.num_prompt_logprobs
    if (logprobs is None) != (wanted is None):
        has = "lacks" if logprobs is None else "carries"
        return f"the request asked for prompt_logprobs={wanted}; the commit {has} them"
    if logprobs is None or wanted is None:
        return None
    prompt = expected.prompt_token_ids
    if len(logprobs) != len(prompt) or len(prompt) != expected.num_prompt_tokens:
        return f"the commit carries {len(logprobs)} prompt logprobs; the prompt has {expected.num_prompt_tokens} tokens"
    if logprobs[0] is not None:
        return "the commit carries logprobs for the first prompt token, which has none"
    for position, (token, lp) in enumerate(zip(prompt[1:], logprobs[1:]), start=1):
        problem = "it has none" if lp is None else _position_problem(expected, token, lp, wanted,
                                                                     f"prompt token {position}")
        if problem is not None:
            return f"prompt position {position}: {problem}"
    return None


def _position_problem(expected: Expected, token: int, logprobs: TokenLogprobsMsg, num_top: int,
                      what: str) -> str | None:
    """One position's logprobs: of `token`, `num_top` alternatives, ids in the vocabulary, values
    in [-inf, 0], a rank (where one is sent) among the vocabulary's."""
    if logprobs.token_id != token:
        return f"the logprobs are of token {logprobs.token_id}, {what} is {token}"
    if len(logprobs.top) != num_top:
        return f"the commit carries {len(logprobs.top)} alternatives, the request asked for {num_top}"
    if logprobs.rank is not None and not 1 <= logprobs.rank <= expected.vocab_size:
        return f"rank {logprobs.rank} is outside [1, {expected.vocab_size}]"
    pairs = [(token, logprobs.logprob), *logprobs.top]
    # a log-probability is at most 0 (-inf: a masked token); NaN is no number at all
    bad = next(((t, v) for t, v in pairs if not (0 <= t < expected.vocab_size and v <= 0)), None)
    if bad is not None:
        return f"logprob {bad[1]} of token {bad[0]}: token ids lie in [0, {expected.vocab_size}), logprobs in [-inf, 0]"
    return None


def is_generator_state(state: bytes) -> bool:
    """Whether `state` is exactly what `torch.Generator().set_state` takes (its size, and a state it accepts)."""
    if len(state) != GENERATOR_STATE_BYTES:
        return False
    try:
        torch.Generator().set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    except RuntimeError:  # torch checks the mt19937 state's own consistency
        return False
    return True


def _check_coverage(expected: Expected, commit: CommitMsg, landing: Landing) -> Refusal | None:
    claimed = {r.layer: (r.start, r.end) for r in commit.written}
    start, end = expected.num_cached_tokens, expected.num_prompt_tokens
    for layer in range(expected.num_layers):
        for kind in KINDS:
            if any(s < start for s, _ in landing.ranges.get((layer, kind), [])):
                return Refusal("write_outside_reservation", f"layer {layer} {kind.upper()}: KV landed before "
                                                            f"position {start}, in read-only cached pages")
            covered = covered_from(landing, layer, kind, start)
            if covered < end:
                return Refusal("missing_kv", f"layer {layer} {kind.upper()}: only positions [{start}, {covered}) "
                                             f"of [{start}, {end}) arrived for this transfer")
        if claimed.get(layer) != (start, end):
            return Refusal("claim_mismatch", f"layer {layer}: the commit claims {claimed.get(layer)} written, "
                                             f"the transfer is [{start}, {end})")
    if len(claimed) != expected.num_layers or len(commit.written) != expected.num_layers:
        return Refusal("claim_mismatch", f"the commit lists {len(commit.written)} layer ranges; the model has "
                                         f"{expected.num_layers} layers")
    return None


def covered_from(landing: Landing, layer: int, kind: KVKind, start: int) -> int:
    """How far positions from `start` on of `layer`/`kind` landed without a gap (`start` if none)."""
    covered = start
    for first, last in sorted(landing.ranges.get((layer, kind), [])):
        if first > covered:
            break
        covered = max(covered, last)
    return covered
