"""Decode's verification of a commit, before it schedules a single step (I4; docs/ARCHITECTURE.md,
"The handoff, as implemented").

A commit is accepted only if, word for word: it names a live reservation's transfer id; its
request id and tenant are the reservation's; its token count is the prompt length; and for
every layer, for K and for V, the receiver's own landing records cover every prompt position
from the end of decode's prefix-cache hit on, nothing landed before it (those are read-only
cached pages), and the records say exactly what the commit claims. Anything else is refused
with a reason (a metrics label) and a message for the client and the log.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvseal.disagg.msgs import CommitMsg, KVKind
from kvseal.disagg.transport import KINDS, Landing


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
    num_cached_tokens: int = 0  # decode's prefix-cache hit: the transfer covers [this, num_prompt_tokens)


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
    return _check_coverage(expected, commit, landing)


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
