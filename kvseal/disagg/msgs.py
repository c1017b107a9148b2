"""Every message of prefill/decode disaggregation, one per protocol step
(docs/ARCHITECTURE.md, "Prefill/decode disaggregation").

They travel over ZMQ (a DEALER per peer, a ROUTER per engine) as msgpack, decoded only into
`PdMsg`, the one registry. The colocated engine's messages that mean the same thing in PD
mode (abort, outputs, rejection, stats) are reused rather than copied.

The handoff, in order:

    frontend -> decode    ReserveMsg          decode re-admits (I1), holds pages "receiving"
    decode   -> frontend  ReservedMsg | ReserveRefusedMsg
    frontend -> decode    AbortUnsentMsg      instead of what follows, once the request ends before
                                              the frontend sent PrefillMsg: decode frees at once
    frontend -> prefill   PrefillMsg          names the transfer id and decode's pages
    prefill  -> decode    KVBlockMsg ...      the TCP transport's data (tcp-stream: on its own
                                              socket, ended by KVStreamEndMsg; nixl: its WRITEs)
    prefill  -> decode    TransferKeepaliveMsg ...  while prefill holds the request (queued,
                                              compiling, computing): decode restarts the deadline
    prefill  -> decode    CommitMsg | TransferAbortMsg
    prefill  -> frontend  PrefillDoneMsg | PrefillRefusedMsg
    decode   -> frontend  OutputsMsg (first token only after verification) | RequestRejectedMsg

A transfer id is decode's random capability for one reservation: decode accepts KV, commits
and aborts only under a live reservation's id, and only for the pages it reserved. Beside it
decode draws a secret transfer key, which travels only on authenticated links (`ReservedMsg`,
`PrefillMsg`) and never on the KV data path: each tcp-stream record carries an HMAC tag under
it, and NIXL arena tags are derived from it, so knowing a transfer id (it is in logs, and in
every tcp-stream header in clear) is not enough to write a byte into decode's pages.

Every control message travels on a CurveZMQ link whose peer proved its key (`link_auth.py`),
and an engine acts on a message only if the sender's role may send it (frontend or peer
engine); tcp-stream's records (`StreamHeaderMsg`) prove the transfer key instead.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvseal.messages.msgs import (
    AbortMsg,
    EngineStatsMsg,
    ForgetTenantMsg,
    OutputsMsg,
    RequestRejectedMsg,
    RequestTimingMsg,
    SamplingParamsMsg,
    ShutdownMsg,
    TokenLogprobsMsg,
)
from kvseal.types import HANDOFF_FAILED as HANDOFF_FAILED  # a handoff's error_code, beside the other codes

Role = Literal["prefill", "decode"]
KVKind = Literal["k", "v"]

# `PrefillRefusedMsg.code` when prefill's push to decode failed (decode may not know: the frontend tells it)
TRANSFER_FAILED = "kv_transfer_failed"
# `PrefillRefusedMsg.code` when prefill refused a `PrefillMsg` whose fields it cannot use
# (`prefill_check.py`); it told no decode engine: the frontend ends the reservation
INVALID_PREFILL_MSG = "invalid_prefill_message"
TRANSFER_KEY_BYTES = 32  # `ReservedMsg.transfer_key`


class _Msg(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    pass


# ---- discovery and liveness --------------------------------------------------------------


class HelloMsg(_Msg, frozen=True):
    """A frontend asks an engine who it is; the engine answers `EngineInfoMsg`. Sent again
    periodically, so a restarted engine is found without restarting the frontend."""

    frontend_id: str


class EngineInfoMsg(_Msg, frozen=True):
    """An engine's role, identity and limits. The frontend admits against the smallest
    `max_model_len`/`kv_cache_tokens` of all engines (I1) and refuses peers whose KV layout
    differs. `instance_id` changes on every start, so a restart is recognised."""

    role: Role
    address: str
    instance_id: str
    pid: int
    model_name: str
    model_path: str
    architecture: str
    max_model_len: int
    kv_cache_tokens: int
    vocab_size: int
    page_size: int
    num_pages: int
    kv_layout: str  # layers x kv_heads x head_dim x dtype x page layout: must match across peers
    kv_transport: str
    kv_scrub_policy: str  # `CacheConfig.scrub_policy` (I7): what overwrites a freed page here


class PdStatsMsg(_Msg, frozen=True):
    """An engine's counters, sent after each change and in answer to every `HelloMsg`."""

    instance_id: str
    role: Role
    engine: EngineStatsMsg
    num_pages_total: int
    num_reservations: int
    num_transfers: int
    num_transfer_bytes: int
    transfer_s_total: float
    handoff_failures: dict[str, int]
    num_reservations_expired: int
    # I9: refused handshakes by reason (`link_auth.HANDSHAKE_REASONS`), and messages a sender's role may not send
    refused_handshakes: dict[str, int]
    num_refused_messages: int


class IntegrityCheckMsg(_Msg, frozen=True):
    """Ask an engine to run its invariant checks now (operators and tests; O(pages))."""


class IntegrityReportMsg(_Msg, frozen=True):
    """The answer: `error` is None when every page has one owner, queues and pages agree and
    only running requests and reservations hold pages."""

    instance_id: str
    error: str | None
    num_pages_used: int
    num_reservations: int
    num_unfinished: int


# ---- frontend -> decode ------------------------------------------------------------------


class ReserveMsg(_Msg, frozen=True):
    """Reserve decode pages for `prompt_token_ids` plus the first output token.

    Decode looks the prompt's leading full pages up in its prefix cache under the namespace it
    derives from `tenant` (I5), the authenticated frontend's tenant."""

    request_id: str
    tenant: str
    prompt_token_ids: list[int]
    params: SamplingParamsMsg


class ReservedMsg(_Msg, frozen=True):
    """Pages are held "receiving" for this transfer: never preempted, never given to anyone else."""

    request_id: str
    tenant: str
    transfer_id: str
    pages: list[int]  # decode's pages, in position order (cached ones first)
    page_size: int
    kv_address: str  # where the transport delivers KV for this decode engine
    transfer_key: bytes  # the transfer's secret (TRANSFER_KEY_BYTES random bytes): authenticates its KV records
    # Positions [0, num_cached_tokens) are read-only pages of decode's prefix cache (a hit in the
    # request's namespace; page-aligned): nothing may be written there, the transfer starts here.
    num_cached_tokens: int = 0


class ReserveRefusedMsg(_Msg, frozen=True):
    """Decode's admission re-check (I1) refused the request; nothing was reserved."""

    request_id: str
    tenant: str
    code: str
    message: str
    param: str | None
    http_status: int


class AbortUnsentMsg(_Msg, frozen=True):
    """End a request the frontend never sent to a prefill engine, and never will (no
    `PrefillMsg` for it left the frontend): its transfer key went only to that frontend, so
    nothing can write the transfer, and decode frees the reservation at once, without waiting
    for writes (NIXL: `NodeConfig.transfer_drain_s`). Otherwise `AbortMsg`'s meaning; decode
    takes this word only from the frontend that asked for the reservation, and treats it as a
    plain `AbortMsg` from any other."""

    request_id: str
    tenant: str
    reason: str


# `AbortUnsentMsg.reason` for a reservation no request at the frontend awaits (the frontend ended
# or aborted the request before the reservation came back): decode keeps any earlier end of it,
# and its report of this one reaches no client
RESERVATION_UNCLAIMED = "reservation_unclaimed"


# ---- frontend -> prefill -----------------------------------------------------------------


class PrefillMsg(_Msg, frozen=True):
    """Compute the prompt's KV and first token, and hand them to decode's reservation."""

    request_id: str
    tenant: str
    prompt_token_ids: list[int]
    params: SamplingParamsMsg
    transfer_id: str
    decode_address: str  # decode's control address (commit / abort go there)
    decode_public_key: bytes  # the CURVE key decode must prove on that link (z85)
    decode_engine: str  # decode's instance id, for the audit trail
    kv_address: str
    transfer_key: bytes  # `ReservedMsg.transfer_key`: prefill seals its KV records with it
    pages: list[int]  # decode's reserved pages, in position order
    num_cached_tokens: int = 0  # decode already holds [0, this): push from here on (ReservedMsg)


class PrefillDoneMsg(_Msg, frozen=True):
    """Prefill pushed the KV and sent the commit; its own pages are free again."""

    request_id: str
    transfer_id: str
    prefill_engine: str
    num_tokens: int
    num_bytes: int
    transfer_s: float


class PrefillRefusedMsg(_Msg, frozen=True):
    """Prefill did not hand off (its admission re-check refused, it was aborted, or the
    transport failed). It sent `TransferAbortMsg` to decode (best effort); its own pages are
    free. `param` and `http_status` are the refusal's, as that message carries them: the
    frontend answers with them if its word never reached decode (decode then expires the
    reservation, which alone would read as a failed handoff)."""

    request_id: str
    transfer_id: str
    prefill_engine: str
    code: str
    message: str
    param: str | None
    http_status: int


# ---- prefill -> decode -------------------------------------------------------------------


class KVBlockMsg(_Msg, frozen=True):
    """Header of one KV block (tcp: a ZMQ message's first frame; tcp-stream: a record on the
    data stream): K or V of one layer for positions [start, end) of
    the request follows as raw bytes, staged contiguously as whole pages
    (`[num_kv_heads, num_pages, page_size, head_dim]`, zeros past `end`). `start` is
    page-aligned. The destination pages are decode's own reservation: the sender names
    positions, never decode's page ids, so it cannot address anything else."""

    transfer_id: str
    layer: int
    kind: KVKind
    start: int
    end: int


class KVStreamEndMsg(_Msg, frozen=True):
    """The last record of one push on the tcp-stream transport's data connection: every
    `KVBlockMsg` of the transfer went before it on the same stream, `num_bytes` of payload in
    all. Decode verifies a commit only once it has read this record (or the stream broke)."""

    transfer_id: str
    num_bytes: int


# What a tcp-stream data connection carries (never the control channel).
StreamHeaderMsg = KVBlockMsg | KVStreamEndMsg


class WrittenRangeMsg(msgspec.Struct, frozen=True, array_like=True):
    """Positions [start, end) of the request, in `layer`, whose K and V prefill wrote."""

    layer: int
    start: int
    end: int


class CommitMsg(_Msg, frozen=True):
    """Prefill's claim: these positions of every layer were written for this transfer, and
    this is the first sampled token. Decode verifies every word before it runs a step, but for
    `prefill_timing`: figures for /metrics that nothing else reads, kept if they are durations."""

    transfer_id: str
    request_id: str
    tenant: str
    num_tokens: int
    written: list[WrittenRangeMsg]
    first_token: int
    first_logprobs: TokenLogprobsMsg | None
    generator_state: bytes  # the request's sampler state after the first token
    prefill_engine: str
    # the request's `prompt_logprobs`: one entry per prompt token, None first (None: not asked for)
    prompt_logprobs: list[TokenLogprobsMsg | None] | None = None
    # how long the request queued and prefilled on prefill (`decode_s` 0): decode reports them with
    # its own decode time when the request ends (for /metrics, never verified: only figures)
    prefill_timing: RequestTimingMsg | None = None


class TransferKeepaliveMsg(_Msg, frozen=True):
    """Prefill still holds this transfer's request and has not given up on it: it waits in
    prefill's queue, its grammar compiles, or its prompt is being computed. Sent at most every
    `NodeConfig.keepalive_interval_s` per request, between engine steps. Decode restarts the
    reservation's deadline (`--reservation-timeout-s`) on it, as on every KV block that lands:
    the deadline catches a prefill that stopped (died, lost the request, hung in one step),
    not one that is slow. It names the reservation as a commit does (transfer id, request id,
    tenant) and changes nothing else."""

    transfer_id: str
    request_id: str
    tenant: str
    prefill_engine: str


class TransferAbortMsg(_Msg, frozen=True):
    """Prefill will write nothing more for this transfer and the request must not run.

    Sent after prefill's last write: once decode has it, no write of the transfer can still
    land. The refusal travels on to the client as decode's `RequestRejectedMsg`, except an
    isolation check's (`code` isolation_check_failed), which decode reports as an aborted output
    with that `error_code`: the client gets 500 isolation_check_failed and the server counts it.
    """

    transfer_id: str
    request_id: str
    tenant: str
    code: str
    message: str
    param: str | None
    http_status: int
    prefill_engine: str


PdMsg = (
    HelloMsg | EngineInfoMsg | PdStatsMsg | IntegrityCheckMsg | IntegrityReportMsg
    | ReserveMsg | ReservedMsg | ReserveRefusedMsg | AbortUnsentMsg | PrefillMsg
    | PrefillDoneMsg | PrefillRefusedMsg | KVBlockMsg | CommitMsg | TransferKeepaliveMsg | TransferAbortMsg
    | AbortMsg | ForgetTenantMsg | ShutdownMsg | OutputsMsg | RequestRejectedMsg
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PdMsg)


def encode(msg: PdMsg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> PdMsg:
    """Raise `msgspec.DecodeError`/`ValidationError` for anything not in `PdMsg`."""
    return _decoder.decode(data)


_stream_decoder = msgspec.msgpack.Decoder(StreamHeaderMsg)


def encode_stream_header(msg: StreamHeaderMsg) -> bytes:
    return _encoder.encode(msg)


def decode_stream_header(data: bytes | bytearray | memoryview) -> StreamHeaderMsg:
    """Raise `msgspec.DecodeError`/`ValidationError` for anything but a stream header."""
    return _stream_decoder.decode(data)
