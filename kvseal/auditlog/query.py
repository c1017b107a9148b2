"""`kvseal audit`: the requests of the audit log that match a window and a predicate, and for an
incident (`--affected`) the ones that could have carried another tenant's data, with their tenants.

A request matches a window when it was in flight during it: received before the window ends
and finished at or after it starts. Every other filter is an exact test on one field; filters
of different fields must all hold, several values of one field are alternatives.

Affected, for `--affected`: a request that matches and handed its client generated text, that
is every matching request that generated at least one token and was not refused. It counts
whatever its outcome, because a stream cut short by an abort, an error or an isolation check
had already sent its client part of the text. Refusals generated nothing and never count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from kvseal.auditlog.files import TimeWindow
from kvseal.auditlog.record import LoggedRequest


@dataclass(frozen=True)
class Predicate:
    """What a request must be to match (None or empty: any)."""

    tenants: tuple[str, ...] = ()
    key_ids: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    engines: tuple[str, ...] = ()  # any engine that handled it: colocated, PD prefill or decode
    endpoints: tuple[str, ...] = ()
    outcomes: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()
    request_ids: tuple[str, ...] = ()
    min_prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None
    is_isolation_event: bool = False  # only requests an isolation check ended

    def matches(self, r: LoggedRequest) -> bool:
        return (_any(self.tenants, r.tenant) and _any(self.key_ids, r.key_id) and _any(self.models, r.model)
                and _any(self.endpoints, r.endpoint) and _any(self.outcomes, r.outcome)
                and _any(self.reasons, r.reason) and _any(self.request_ids, r.request_id)
                and (not self.engines or bool(set(self.engines) & set(engines_of(r))))
                and self._prompt_fits(r.prompt_tokens)
                and (not self.is_isolation_event or r.outcome == "isolation_violation"))

    def _prompt_fits(self, num_tokens: int | None) -> bool:
        if self.min_prompt_tokens is None and self.max_prompt_tokens is None:
            return True
        if num_tokens is None:
            return False  # refused before it was tokenized: its size is unknown
        return ((self.min_prompt_tokens is None or num_tokens >= self.min_prompt_tokens)
                and (self.max_prompt_tokens is None or num_tokens <= self.max_prompt_tokens))

    def describe(self) -> str:
        """The predicate as the flags that set it ('any request' for none)."""
        parts = [f"--{name} {value}" for name, values in (
            ("tenant", self.tenants), ("key-id", self.key_ids), ("model", self.models), ("engine", self.engines),
            ("endpoint", self.endpoints), ("outcome", self.outcomes), ("reason", self.reasons),
            ("request-id", self.request_ids)) for value in values]
        parts += [f"--{name} {value}" for name, value in (("min-prompt-tokens", self.min_prompt_tokens),
                                                           ("max-prompt-tokens", self.max_prompt_tokens))
                  if value is not None]
        parts += ["--isolation-events"] if self.is_isolation_event else []
        return " ".join(parts) or "any request"


def _any(values: tuple[str, ...], value: str | None) -> bool:
    return not values or value in values


def engines_of(r: LoggedRequest) -> list[str]:
    return [e for e in (r.engine, r.prefill_engine, r.decode_engine) if e is not None]


def matching(records: Iterable[LoggedRequest], window: TimeWindow, predicate: Predicate) -> list[LoggedRequest]:
    """The requests in flight during `window` that match `predicate`, in the log's order."""
    return [r for r in records if window.overlaps(r.received_at, r.finished_at) and predicate.matches(r)]


def could_carry_text(r: LoggedRequest) -> bool:
    """Whether the request handed its client generated text (the module's "affected")."""
    return r.outcome != "rejected" and (r.output_tokens or 0) > 0


@dataclass(frozen=True)
class Affected:
    requests: list[LoggedRequest]
    num_by_tenant: dict[str, int]  # tenant -> affected requests, most first

    @classmethod
    def among(cls, requests: Iterable[LoggedRequest]) -> Affected:
        affected = [r for r in requests if could_carry_text(r)]
        counts = Counter(r.tenant or "-" for r in affected)
        return cls(affected, dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))))
