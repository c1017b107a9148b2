"""Test-only fault switches that deliberately break an isolation guarantee.

Each isolation check must be shown to fail when the thing it guards is broken; tests switch
a fault on with `inject(...)` and assert that the check catches it. Production code only
ever asks `is_active(...)`; no flag, environment variable or config field can turn one on.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator


class Fault(enum.Enum):
    # The incident's path: a prompt's prefill is replaced by a one-token placeholder, yet
    # the request is treated as if its whole prompt had been computed.
    PLACEHOLDER_PREFILL = "placeholder_prefill"
    # A block table that names a page another request owns (an I3 violation).
    FOREIGN_PAGE = "foreign_page"
    # Switch off every read-before-write and ownership check (the always-on coverage check and
    # checked mode), so a test can show that an outer layer (the canary run) catches a leak
    # the checks would otherwise have stopped first.
    BYPASS_KV_CHECKS = "bypass_kv_checks"
    # The HTTP frontend skips its own admission call (I1 at the door), so a test can show that
    # the front-door check is what refuses an over-long prompt, not the engine's re-check.
    SKIP_FRONT_DOOR_ADMISSION = "skip_front_door_admission"
    # Decode accepts a PD commit without verifying it (token count, per-layer coverage), so a
    # test can show that the canary markers catch what that verification would have stopped.
    SKIP_HANDOFF_VERIFY = "skip_handoff_verify"
    # The prefix cache keys pages by their token hash alone, without the tenant's namespace
    # (I5), so a test can show that the cross-tenant check sees another tenant's hit and that
    # the ownership check (I3) refuses the foreign page before a forward reads it.
    DROP_CACHE_NAMESPACE = "drop_cache_namespace"
    # An engine told to forget a tenant's prefix cache (its name was removed from the keys)
    # starts a new cache epoch for the name but leaves the old pages cached, so a test can show
    # that the cache's integrity check sees a forgotten tenant's page outlive its readers.
    FORGET_KEEPS_CACHE = "forget_keeps_cache"
    # The frontend ignores a failed audit write (I8), as it did before the audit guard: the
    # answer is sent, new requests are admitted and /health is fine, so a test can show that
    # the outage test catches a response served without its audit line.
    IGNORE_AUDIT_FAILURE = "ignore_audit_failure"
    # The front door skips the request-shape checks that guard shared resources: the bounds
    # that depend on the engine's limits (/detokenize's token count, the text the chat template
    # renders besides the messages), the refusal of two Authorization headers, and the key on
    # /openapi.json, so a test can show that each of their tests notices.
    SKIP_DOOR_CHECKS = "skip_door_checks"
    # An engine's link authentication is off (I9): its ZAP handler lets any CURVE key finish the
    # handshake, and a key on neither allow-list acts as a frontend (the world before I9), so a
    # test can show that a stranger's reservation then reads the cached-token count of another
    # tenant's prompt, and that the allow-list is what stops it.
    OPEN_ENGINE_LINKS = "open_engine_links"
    # An engine acts on every message of an authenticated peer whatever its role may send (a
    # prefill engine's key could reserve, read stats or shut decode down), so a test can show
    # that the per-message role check is what refuses them.
    SKIP_LINK_ROLE_CHECK = "skip_link_role_check"
    # Decode's tcp-stream receiver takes a record's header without checking its HMAC tag, so a
    # test can show that a stranger who knows a transfer id then lands bytes in decode's pages,
    # and that the tag check is what stops it.
    SKIP_STREAM_TAG_CHECK = "skip_stream_tag_check"
    # Grammar compiles wait in one FIFO over all tenants, a tenant's compiles running side by
    # side, so a test can show that another tenant's small grammar then waits behind them.
    SHARED_GRAMMAR_QUEUE = "shared_grammar_queue"
    # Grammar compiles get no time budget (the worker is never stopped for running over), so a
    # test can show that the over-budget refusal is what frees the worker.
    UNBUDGETED_GRAMMAR_COMPILE = "unbudgeted_grammar_compile"
    # A compile whose every waiting request left (abort, disconnect) keeps running, so a test
    # can show that the cancellation is what frees the worker, not the budget.
    IGNORE_GRAMMAR_CANCEL = "ignore_grammar_cancel"
    # Tool definitions skip the door checks response_format's schema gets (size, depth, count,
    # the number and total size of tools), so a test can show that those checks refuse them.
    SKIP_TOOL_DOOR_CHECKS = "skip_tool_door_checks"
    # The hermes tool-call parser keeps the last call it read, across requests, and gives each
    # call it reads the arguments of the one before (a parser's state shared by every request), so
    # a test can show that the canary finds one request's marker in another's call.
    STALE_TOOL_ARGUMENTS = "stale_tool_arguments"
    # An aborted request keeps its pages and its place in the scheduler (I6): the abort reports
    # the request ended but frees nothing, so a test can show that the abort test sees the pages
    # still in use.
    ABORT_KEEPS_PAGES = "abort_keeps_pages"
    # The frontend answers an aborted request as a success (I6): no error, the stream ends with
    # `[DONE]` after what was generated, a non-streamed answer is a 200, so a test can show that
    # the lifecycle test notices an abort passed off as a finished answer.
    ABORT_AS_SUCCESS = "abort_as_success"
    # A reload of the API keys file adds its keys but keeps the old ones it no longer has, so a
    # test can show that the revocation test notices a removed key that still works (and that
    # its in-flight requests are not aborted).
    KEEP_REVOKED_KEYS = "keep_revoked_keys"
    # Every tenant draws on one requests bucket and one tokens bucket (per kind, not per tenant),
    # so a test can show that one tenant's use then gets another tenant 429s.
    SHARED_RATE_LIMITS = "shared_rate_limits"

    # Decode's NIXL receiver zeroes only the tags of the arena pages it hands to a transfer, never
    # their KV, and gives them back as they are (the world before arena zeroing), so a test can
    # show that a short WRITE then hands a transfer the KV an earlier transfer (another tenant's)
    # left in its arena pages, and that released arena pages keep a tenant's KV readable.
    SKIP_ARENA_ZEROING = "skip_arena_zeroing"
    # Prefill's NIXL WRITE leaves out the V of layer 0 (a dropped descriptor, a sender bug) while
    # its notification still names layer 0 as written, K and V, so a test can show what decode
    # then imports for it: zeros, never another transfer's KV.
    SHORT_NIXL_WRITE = "short_nixl_write"

    # One tensor-parallel rank stores each decoded token's K/V one slot over, within its page (a
    # kernel writing the wrong slot), so a test can show that checked mode's per-slot records on
    # that rank refuse the next read of the slot it never wrote, where the always-on check does not.
    MISPLACED_KV_WRITE = "misplaced_kv_write"
    # A tensor-parallel decode rank drops its shard of an imported PD handoff (a scatter that never
    # reached its pool): nothing is written or recorded there, so a test can show that the rank's
    # report refuses the handoff, and with decode's verification skipped, that the rank's own
    # always-on check refuses the first decode step.
    DROP_IMPORT_SHARD = "drop_import_shard"
    # A tensor-parallel rank accepts every rank's handshake tag without checking it (the world
    # before rank-link authentication: whoever joins the rendezvous is a rank), so a test can
    # show that a rogue joining as rank 1 without the key then gets the ranks' step messages,
    # every tenant's token ids among them, and that the tag check is what stops it.
    SKIP_RANK_AUTH = "skip_rank_auth"
    # An engine's link to a peer fails during setup with an error nothing expects, its socket left
    # open (as a malformed CURVE key in a PrefillMsg once did: the engine loop died and the process
    # then hung in `Context.term()` on that socket, alive and serving nothing), so a test can show
    # that an engine whose loop dies exits non-zero, for its supervisor to restart it.
    BREAK_PEER_LINK_SETUP = "break_peer_link_setup"

_active: set[Fault] = set()


def is_active(fault: Fault) -> bool:
    return fault in _active


def switch(fault: Fault, active: bool) -> None:
    """Turn a fault on or off in this process: a tensor-parallel worker rank's side of
    `TensorParallelDriver.inject_fault_on_rank` (a test's call, never a flag or config)."""
    if active:
        _active.add(fault)
    else:
        _active.discard(fault)


@contextlib.contextmanager
def inject(fault: Fault) -> Iterator[None]:
    _active.add(fault)
    try:
        yield
    finally:
        _active.discard(fault)
