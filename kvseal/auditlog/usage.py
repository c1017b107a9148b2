"""`kvseal usage`: per-tenant (or per-key) totals from the audit log, for billing.

A request counts in the window it was *received* in. Token totals are those of the answered
requests (outcome `finished`): exactly the `usage` their clients were sent (prompt tokens once
per request whatever its `n`, completion tokens summed over its choices, cached prompt tokens).
Requests that ended otherwise are counted by outcome, rejections by reason; the tokens an
aborted or failed request generated are totalled apart (`unanswered_completion_tokens`). Calls
to /tokenize and /detokenize are counted apart too (`tokenize_requests`): they generate nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from kvseal.auditlog.files import TimeWindow
from kvseal.auditlog.record import LoggedRequest

GroupBy = Literal["tenant", "key"]
TOKENIZE_ENDPOINTS = ("/tokenize", "/detokenize")
NO_KEY = "-"  # the key column of requests made without a keys file (or refused before their key was read)


@dataclass
class UsageTotals:
    requests: int = 0  # generation requests, whatever their outcome
    finished: int = 0
    rejected: int = 0
    aborted: int = 0
    error: int = 0
    isolation_violation: int = 0
    prompt_tokens: int = 0  # of finished requests, as in their `usage`
    cached_tokens: int = 0
    completion_tokens: int = 0
    unanswered_completion_tokens: int = 0  # generated for requests that did not finish
    tokenize_requests: int = 0
    rejections: Counter[str] = field(default_factory=Counter)  # reason -> count

    def add(self, record: LoggedRequest) -> None:
        if record.endpoint in TOKENIZE_ENDPOINTS:
            self.tokenize_requests += 1
            return
        self.requests += 1
        setattr(self, record.outcome, getattr(self, record.outcome) + 1)
        if record.outcome == "rejected":
            self.rejections[record.reason or "(none)"] += 1
        if record.outcome == "finished":
            self.prompt_tokens += record.prompt_tokens or 0
            self.cached_tokens += record.cached_tokens or 0
            self.completion_tokens += record.output_tokens or 0
        else:
            self.unanswered_completion_tokens += record.output_tokens or 0


COUNT_FIELDS = ("requests", "finished", "rejected", "aborted", "error", "isolation_violation", "prompt_tokens",
                "cached_tokens", "completion_tokens", "unanswered_completion_tokens", "tokenize_requests")


def group_of(record: LoggedRequest, by: GroupBy) -> tuple[str, ...]:
    tenant = record.tenant if record.tenant is not None else NO_KEY
    return (tenant,) if by == "tenant" else (tenant, record.key_id or NO_KEY)


def usage_totals(records: Iterable[LoggedRequest], window: TimeWindow,
                 by: GroupBy) -> dict[tuple[str, ...], UsageTotals]:
    """Totals per group (tenant, or tenant and key id) of the requests received in `window`,
    sorted by group. Requests refused before their key was checked have tenant '-'."""
    totals: dict[tuple[str, ...], UsageTotals] = {}
    for record in records:
        if window.holds(record.received_at):
            totals.setdefault(group_of(record, by), UsageTotals()).add(record)
    return dict(sorted(totals.items()))


def usage_rows(totals: dict[tuple[str, ...], UsageTotals], by: GroupBy) -> list[dict[str, object]]:
    """One flat row per group: the group's names, the counts, and the rejections by reason."""
    names = ("tenant",) if by == "tenant" else ("tenant", "key_id")
    rows: list[dict[str, object]] = []
    for group, t in totals.items():
        row: dict[str, object] = dict(zip(names, group))
        row.update({name: getattr(t, name) for name in COUNT_FIELDS})
        row["rejections"] = dict(sorted(t.rejections.items()))
        rows.append(row)
    return rows
