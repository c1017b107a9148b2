"""One audit line as the readers see it: the writer's record (`kvseal.server.audit.AuditRecord`),
field for field (a test pins that), with the prompt left as whatever JSON it was (msgspec cannot
decode the writer's union of prompt shapes, and no query reads it)."""

from __future__ import annotations

from typing import Any

import msgspec

from kvseal.server.audit import Outcome, RejectedBy


class LoggedRequest(msgspec.Struct, frozen=True):
    request_id: str
    endpoint: str
    tenant: str | None
    outcome: Outcome
    received_at: float
    finished_at: float
    http_status: int | None = None
    model: str | None = None
    reason: str | None = None
    detail: str | None = None
    rejected_by: RejectedBy | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    pages_reserved: int | None = None
    kv_tokens_written: int | None = None
    cached_tokens: int | None = None
    first_token_at: float | None = None
    user: str | None = None
    key_id: str | None = None
    features: list[str] | None = None
    engine: str | None = None
    prefill_engine: str | None = None
    decode_engine: str | None = None
    transfer_id: str | None = None
    prompt: Any = None
    written_late: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set, as the line had them (the prompt left out)."""
        return {name: value for name in self.__struct_fields__ if name != "prompt"
                and (value := getattr(self, name)) is not None and value is not False}
