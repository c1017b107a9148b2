"""The audit log (I8): exactly one JSON line per request, whatever its outcome, and no
successful answer without its line.

Enough to answer "which responses could have been affected" after an incident: who (tenant),
what (token counts, KV pages reserved), how it ended (finished, rejected and by whom, aborted
and why, error, isolation_violation and which check) and when. Client-controlled strings
(model, user, reasons) are clipped to `MAX_LOGGED_CHARS`. No prompt text unless the operator passes --audit-log-prompts.
Without --audit-log the lines go to the `kvseal.audit` logger instead of a file.

When the file cannot be written (a full disk, a read-only or deleted directory), `AuditLog`
says so instead of raising: the caller withholds the answer (503 `audit_unavailable`, or an
error event ending a stream), new generation requests are refused until the file works
again, and the records meanwhile wait in a bounded queue, written first once it does.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from kvseal._testing.faults import Fault, is_active
from kvseal.server.audit_file import AuditFile

Outcome = Literal["finished", "rejected", "aborted", "error", "isolation_violation"]
RejectedBy = Literal["frontend", "engine"]  # which admission check refused the request (I1)

KEY_ID_HEX_DIGITS = 12  # 48 bits: names a key among an operator's keys, useless for guessing a random one
MAX_LOGGED_CHARS = 256  # every client-controlled string is clipped to this before it is logged
AUDIT_UNAVAILABLE = "audit_unavailable"  # the error code, and the reason in a late record of a withheld answer
RETRY_S = 1.0  # a failing audit file is tried again at most this often
MAX_PENDING_RECORDS = 10_000  # records kept in memory while the file fails; later ones are lost (counted)
MAX_PENDING_BYTES = 64 * 1024 * 1024  # and their lines' bytes (with --audit-log-prompts a line holds a prompt)


def clip(text: str) -> str:
    """`text`, cut to `MAX_LOGGED_CHARS` (with a marker saying how long it was)."""
    if len(text) <= MAX_LOGGED_CHARS:
        return text
    return f"{text[:MAX_LOGGED_CHARS]}...[{len(text)} chars]"


def clip_optional(text: str | None) -> str | None:
    return None if text is None else clip(text)


def key_id_of(authorization: str | None) -> str | None:
    """The audit log's name for the API key in `Authorization: Bearer KEY`: the first 12 hex digits
    of its SHA-256 (`printf %s KEY | sha256sum | cut -c1-12`), never the key. None without one."""
    scheme, _, key = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return hashlib.sha256(key.strip().encode()).hexdigest()[:KEY_ID_HEX_DIGITS]

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
    detail: str | None = None  # an engine loss's words beside its reason code (how the engine ended)
    rejected_by: RejectedBy | None = None  # for outcome "rejected" at admission: the frontend or the engine
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    pages_reserved: int | None = None
    kv_tokens_written: int | None = None  # KV slots written for the request, at its end
    cached_tokens: int | None = None  # prompt tokens served from its tenant's prefix cache (I5)
    first_token_at: float | None = None
    user: str | None = None
    key_id: str | None = None  # with --api-keys: which key the request came with (`key_id_of`)
    features: list[str] | None = None  # optional request fields used (names only, kvseal.server.features)
    engine: str | None = None  # colocated: the engine process that handled it (`engine-PID`; a restart is a new one)
    prefill_engine: str | None = None  # PD mode: the engines that handled the request and the KV transfer id
    decode_engine: str | None = None
    transfer_id: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]] | list[dict[str, Any]] | None = None
    written_late: bool = False  # the file failed when the request ended: written once it worked again


AdminAction = Literal["keys_reloaded", "keys_reload_refused", "model_disabled", "model_enabled",
                      "tenant_cache_forgotten"]


class AdminRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """One operator action on the running server (`kvseal.server.admin`), in the same log as
    the requests it affects. A line is an admin record when it has `admin_action`."""

    admin_action: AdminAction
    at: float  # Unix time, seconds
    trigger: Literal["http", "sighup"]
    by_tenant: str | None = None  # the admin key's tenant and key id (http); none for a signal
    by_key_id: str | None = None
    model: str | None = None
    keys_added: list[str] | None = None  # key ids (`ApiKey.key_id`), never keys
    keys_removed: list[str] | None = None  # removed or revoked
    keys_moved: list[dict[str, str]] | None = None  # {"key_id", "from_tenant", "to_tenant"}: now another tenant's
    tenants_changed: list[str] | None = None  # tenants whose limits changed
    # tenants whose prefix cache the engines were told to forget: every key of the name was removed
    # (a reload), or the operator asked (tenant_cache_forgotten, one name)
    tenants_forgotten: list[str] | None = None
    num_engines_told: int | None = None  # engines the forget reached at once (a down one is told when back)
    num_aborted: int | None = None  # in-flight requests ended by the action (abort=true)
    reason: str | None = None  # why a reload was refused
    written_late: bool = False


@dataclass(frozen=True)
class AuditStats:
    """For /metrics."""

    is_up: bool
    num_write_failures: int  # writes to the file that failed (each retry counts)
    num_pending: int  # records waiting for the file to work again
    num_dropped: int  # records lost: the queue was full


class AuditLog:
    """Writes each request's record; never raises.

    `write` returns True once the line is in the file (or handed to the logger), False when it
    could not be written now. From a failed write until the file works again the log is
    *failing* (`failure` says why, for /health and error messages): every record waits in a
    bounded queue, and the file is tried again at most once per `retry_s`, by the next `write`
    or `check`. The first write that works writes the waiting lines first, in order.

    A record waits in its late version (`written_late`): one that had finished becomes an error
    with reason `audit_unavailable`, because the caller withheld that success from its client.
    """

    def __init__(self, path: str | None, include_prompts: bool, *, retry_s: float = RETRY_S,
                 max_pending: int = MAX_PENDING_RECORDS, max_pending_bytes: int = MAX_PENDING_BYTES,
                 max_bytes: int | None = None, max_age_s: float | None = None, num_backups: int | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """`max_bytes`, `max_age_s` and `num_backups`: the file's rotation, `clock` the wall clock
        its age is measured by (`kvseal.server.audit_file`)."""
        self.path = path
        self.include_prompts = include_prompts
        self.retry_s = retry_s
        # OSError here stops start-up
        self._file = (AuditFile(path, max_bytes=max_bytes, max_age_s=max_age_s, num_backups=num_backups, clock=clock)
                      if path is not None else None)
        self._encoder = msgspec.json.Encoder()
        self._pending: deque[bytes] = deque()
        self._num_pending_bytes = 0
        self._max_pending = max_pending
        self._max_pending_bytes = max_pending_bytes
        self._failure: str | None = None
        self._retry_at_s = 0.0
        self._num_write_failures = 0
        self._num_dropped = 0

    @property
    def failure(self) -> str | None:
        """Why the audit log cannot be written now; None while it works."""
        return None if is_active(Fault.IGNORE_AUDIT_FAILURE) else self._failure

    @property
    def retry_after_s(self) -> int:
        """Seconds a refused client should wait (Retry-After)."""
        return max(1, math.ceil(self.retry_s))

    @property
    def stats(self) -> AuditStats:
        return AuditStats(self._failure is None, self._num_write_failures, len(self._pending), self._num_dropped)

    def write(self, record: AuditRecord | AdminRecord) -> bool:
        """Append `record`'s line; True once it is written. Never raises."""
        if self._failure is None or self._recovered():
            try:
                self._append(self._encode(record))
                return True
            except Exception as exc:  # whatever breaks the sink must not reach the caller
                self._failed(exc)
        self._keep(record)
        return self.failure is None

    def check(self) -> str | None:
        """`failure`, after trying the file again if it is failing and its back-off is over."""
        if self._failure is not None:
            self._recovered()
        return self.failure

    def close(self) -> None:
        """Write what still waits, if the file works now, and close it."""
        if self._failure is not None:
            self._retry_at_s = 0.0
            self._recovered()
        if self._pending or self._num_dropped:
            logger.error("%d audit records could not be written (and %d were dropped)", len(self._pending),
                         self._num_dropped)
        if self._file is not None:
            self._file.close()

    def _encode(self, record: AuditRecord | AdminRecord) -> bytes:
        return self._encoder.encode(record) + b"\n"

    def _append(self, line: bytes) -> None:
        if self._file is None:
            logger.info("%s", line[:-1].decode())
        else:
            self._file.append(line)

    def _recovered(self) -> bool:
        """Retry a failing file when its back-off is over: write every waiting line, in order."""
        if time.monotonic() < self._retry_at_s:
            return False
        try:
            if self._file is not None:
                self._file.probe()
            while self._pending:
                self._append(self._pending[0])
                self._num_pending_bytes -= len(self._pending.popleft())
        except Exception as exc:
            self._failed(exc)
            return False
        logger.warning("the audit log %s is writable again: wrote the records that waited for it (%d were "
                       "dropped); accepting requests again", self.path, self._num_dropped)
        self._failure = None
        return True

    def _failed(self, exc: Exception) -> None:
        self._num_write_failures += 1
        self._retry_at_s = time.monotonic() + self.retry_s
        if self._failure is None:
            logger.error("cannot write the audit log %s (%s): answers are withheld and new generation requests "
                         "refused with 503 %s until it can be written; retrying every %g s", self.path, exc,
                         AUDIT_UNAVAILABLE, self.retry_s, exc_info=not isinstance(exc, OSError))
        self._failure = f"cannot write the audit log: {public_reason(exc)}"

    def _keep(self, record: AuditRecord | AdminRecord) -> None:
        try:
            line = self._encode(late(record))
        except Exception:  # a record that cannot be encoded is lost, not raised
            logger.exception("cannot encode the audit record of %s",
                             record.request_id if isinstance(record, AuditRecord) else record.admin_action)
            self._num_dropped += 1
            return
        if (len(self._pending) >= self._max_pending
                or self._num_pending_bytes + len(line) > self._max_pending_bytes):
            self._drop()
            return
        self._pending.append(line)
        self._num_pending_bytes += len(line)

    def _drop(self) -> None:
        if not self._num_dropped:
            logger.error("the audit log has %d records (%d bytes) waiting; dropping further records until it can "
                         "be written (counted in kvseal_audit_records_dropped_total)", len(self._pending),
                         self._num_pending_bytes)
        self._num_dropped += 1


def late(record: AuditRecord | AdminRecord) -> AuditRecord | AdminRecord:
    """The record as written after the file failed: a finished request's answer was withheld."""
    if isinstance(record, AuditRecord) and record.outcome == "finished":
        return msgspec.structs.replace(record, outcome="error", reason=AUDIT_UNAVAILABLE, written_late=True)
    return msgspec.structs.replace(record, written_late=True)


def public_reason(exc: Exception) -> str:
    """Why a write failed, fit for clients and the unauthenticated /health: the operating system's
    reason ('No space left on device') without the file's path, which stays in the server's log."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__
