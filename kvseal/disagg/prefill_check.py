"""What a prefill engine checks of a `PrefillMsg` before it uses a field of it.

A `PrefillMsg` comes from a frontend key holder: the frontend, a buggy one, or whoever stole its
key. msgspec checked its types; what the types allow and prefill cannot use (a negative or
unaligned position, pages that do not fit the prompt, a key or address of the wrong form) is
refused here with `MalformedPrefillMsg`, before anything reads it: such a value once reached a
`PushPlan` or a ZMQ socket option and the exception ended the engine loop. Prefill then answers
its sender only and connects to no address the message names (the frontend ends decode's
reservation). The prompt and sampling parameters are admission's (I1), as for every request; the
checks that depend on the admitted prompt run after it (`check_handoff`).

The KV address is the transport's: tcp-stream and tcp want HOST:PORT, nixl its own encoding, and
each sender refuses a malformed one with `TransportError` at the push (a transfer failure).
"""

from __future__ import annotations

import re

from kvseal.disagg.link_keys import PublicKey, is_curve_key
from kvseal.disagg.msgs import TRANSFER_KEY_BYTES, PrefillMsg
from kvseal.errors import KvsealError

TRANSFER_ID = re.compile(r"[0-9a-f]{32}")  # decode's `secrets.token_hex(16)`
HOST = re.compile(r"[A-Za-z0-9._\-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")  # a name, IPv4, or [IPv6]
MAX_NAME_CHARS = 256  # request ids and instance ids are far shorter; this only bounds logs
MAX_KV_ADDRESS_CHARS = 1 << 16  # nixl's carries the agent's metadata


class MalformedPrefillMsg(KvsealError):
    """A `PrefillMsg` field prefill cannot use; `str()` names the field, the value and the range."""


def check_prefill_msg(msg: PrefillMsg, own_public_key: bytes, frontends: tuple[PublicKey, ...]) -> None:
    """The fields that do not depend on the prompt: ids, the decode link, the transfer's secret.

    A decode key that is this engine's own, or on its frontend allow-list, is refused too: prefill
    cannot know decode's keys at start-up, and a decode key accepted as a frontend lets whoever
    holds it use the whole frontend protocol here (SECURITY.md, "Engine links")."""
    _check_name("request_id", msg.request_id)
    _check_name("tenant", msg.tenant, max_chars=None)
    _check_name("decode_engine", msg.decode_engine)
    if not TRANSFER_ID.fullmatch(msg.transfer_id):
        raise MalformedPrefillMsg(f"transfer_id {msg.transfer_id[:40]!r} is not decode's 32 lowercase hex digits")
    _check_host_port("decode_address", msg.decode_address)
    if not is_curve_key(msg.decode_public_key):
        raise MalformedPrefillMsg(f"decode_public_key is {len(msg.decode_public_key)} bytes that are not a CURVE "
                                  f"public key (40 z85 characters)")
    _check_decode_key_role(msg.decode_public_key, own_public_key, frontends)
    if len(msg.transfer_key) != TRANSFER_KEY_BYTES:
        raise MalformedPrefillMsg(f"transfer_key is {len(msg.transfer_key)} bytes, not {TRANSFER_KEY_BYTES}")
    if not 0 < len(msg.kv_address) <= MAX_KV_ADDRESS_CHARS:
        raise MalformedPrefillMsg(f"kv_address has {len(msg.kv_address)} characters, not 1..{MAX_KV_ADDRESS_CHARS}")


def check_handoff(msg: PrefillMsg, num_prompt_tokens: int, page_size: int) -> None:
    """Decode's pages and cache hit against the admitted prompt: decode reserved the prompt plus the
    first output token, in distinct pages, and its hit is whole pages short of the last token."""
    num_pages = -(-(num_prompt_tokens + 1) // page_size)
    if len(msg.pages) != num_pages:
        raise MalformedPrefillMsg(f"pages lists {len(msg.pages)} pages; {num_prompt_tokens} prompt tokens and the "
                                  f"first output token take {num_pages} of {page_size} tokens")
    if min(msg.pages) < 0 or len(set(msg.pages)) != len(msg.pages):
        raise MalformedPrefillMsg("pages must be distinct page ids >= 0")
    cached = msg.num_cached_tokens
    if not 0 <= cached < num_prompt_tokens or cached % page_size:
        raise MalformedPrefillMsg(f"num_cached_tokens {cached} must be a multiple of the page size {page_size} in "
                                  f"[0, {num_prompt_tokens}) (the prompt's last token is never cached)")


def _check_name(field: str, value: str, max_chars: int | None = MAX_NAME_CHARS) -> None:
    if not value:
        raise MalformedPrefillMsg(f"{field} is empty")
    if max_chars is not None and len(value) > max_chars:
        raise MalformedPrefillMsg(f"{field} has {len(value)} characters, more than {max_chars}")


def _check_host_port(field: str, address: str) -> None:
    host, _, port = address.rpartition(":")
    if not HOST.fullmatch(host) or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise MalformedPrefillMsg(f"{field} {address[:80]!r} is not HOST:PORT with a port in 1..65535")


def _check_decode_key_role(key: bytes, own_public_key: bytes, frontends: tuple[PublicKey, ...]) -> None:
    if key == own_public_key:
        raise MalformedPrefillMsg("decode_public_key is this prefill engine's own key")
    frontend = next((k for k in frontends if k.key == key), None)
    if frontend is not None:
        raise MalformedPrefillMsg(f"decode_public_key is on this prefill engine's --frontend-keys ({frontend}): a "
                                  f"decode engine's key must not be a frontend's; remove it there and restart")
