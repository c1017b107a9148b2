"""The audit log (I8): exactly one JSON line per generation request, whatever its outcome.

Enough to answer "which responses could have been affected" after an incident: who (tenant),
what (token counts, KV pages reserved), how it ended (finished, rejected and by whom, aborted
and why, error, isolation_violation and which check) and when. Client-controlled strings
(model, user, reasons) are clipped to `MAX_LOGGED_CHARS`. No prompt text unless the operator passes --audit-log-prompts.
Without --audit-log the lines go to the `kvseal.audit` logger instead of a file.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import msgspec

Outcome = Literal["finished", "rejected", "aborted", "error", "isolation_violation"]
RejectedBy = Literal["frontend", "engine"]  # which admission check refused the request (I1)

MAX_LOGGED_CHARS = 256  # every client-controlled string is clipped to this before it is logged


def clip(text: str) -> str:
    """`text`, cut to `MAX_LOGGED_CHARS` (with a marker saying how long it was)."""
    if len(text) <= MAX_LOGGED_CHARS:
        return text
    return f"{text[:MAX_LOGGED_CHARS]}...[{len(text)} chars]"


def clip_optional(text: str | None) -> str | None:
    return None if text is None else clip(text)

logger = logging.getLogger("kvseal.audit")


class AuditRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    request_id: str
    endpoint: str
    tenant: str | None
    outcome: Outcome
    received_at: float  # Unix time, seconds
    finished_at: float
    http_status: int | None = None  # set for refusals; an admitted request answers 200
    model: str | None = None
    reason: str | None = None  # rejection code, abort reason, error or isolation check
    rejected_by: RejectedBy | None = None  # for outcome "rejected" at admission: the frontend or the engine
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    pages_reserved: int | None = None
    kv_tokens_written: int | None = None  # KV slots written for the request, at its end
    cached_tokens: int | None = None  # prompt tokens served from its tenant's prefix cache (I5)
    first_token_at: float | None = None
    user: str | None = None
    features: list[str] | None = None  # optional request fields used (names only, kvseal.server.features)
    prefill_engine: str | None = None  # PD mode: the engines that handled the request and the KV transfer id
    decode_engine: str | None = None
    transfer_id: str | None = None
    prompt: str | list[int] | list[dict[str, Any]] | None = None


class AuditLog:
    def __init__(self, path: str | None, include_prompts: bool) -> None:
        self.path = path
        self.include_prompts = include_prompts
        self._file = open(path, "a", buffering=1, encoding="utf-8") if path is not None else None  # noqa: SIM115
        self._encoder = msgspec.json.Encoder()

    def write(self, record: AuditRecord) -> None:
        line = self._encoder.encode(record).decode()
        if self._file is None:
            logger.info("%s", line)
        else:
            self._file.write(line + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
