"""The ranks' mutual authentication: every rank proves it holds the engine's key, to every rank.

torch.distributed's rendezvous authenticates nobody: any process that reaches
master_addr:master_port while the group forms can take a rank's place, and would then get every
step's batch (every tenant's token ids) and, with PD, tenants' KV heads. So right after a group
forms, before it carries anything else (`RankGroup`), the ranks run two all-gathers:

1. every rank sends a fresh random nonce; every rank now holds all N nonces;
2. every rank sends HMAC-SHA256(key, label | world size | its rank | all N nonces).

Every rank recomputes every other rank's tag and compares in constant time; any mismatch and
the group is refused on that rank, so on every honest rank (each sees the same bad tag). A tag
names its rank, so it cannot be replayed in another rank's place; it covers every rank's fresh
nonce, so each verifier (not only rank 0) knows it was made for this group, now, and no tag
recorded from an earlier start is accepted. What a rank without the key receives before it is
refused: the other ranks' nonces (random) and tags (useless without the key).

Fixed-size raw bytes, not msgspec messages: nothing a stranger sends before it is authenticated
is decoded, or sizes a buffer. No torch here; `group.py` moves the bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 32
TAG_BYTES = hashlib.sha256().digest_size
_DOMAIN = b"kvseal tensor-parallel rank auth v1\x00"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def tag_of(key: bytes, label: str, world_size: int, rank: int, nonces: list[bytes]) -> bytes:
    """Rank `rank`'s proof for this group (`label`: which of the engine's groups) and these nonces."""
    if len(nonces) != world_size or any(len(n) != NONCE_BYTES for n in nonces):
        raise ValueError(f"a rank tag covers {world_size} nonces of {NONCE_BYTES} bytes")
    message = b"".join([_DOMAIN, label.encode(), b"\x00", world_size.to_bytes(4, "big"), rank.to_bytes(4, "big"),
                        *nonces])
    return hmac.new(key, message, hashlib.sha256).digest()


def refused_ranks(key: bytes, label: str, me: int, nonces: list[bytes], tags: list[bytes]) -> list[int]:
    """The ranks other than `me` whose tag is not the one only a holder of `key` could make."""
    world_size = len(tags)
    return [rank for rank, tag in enumerate(tags)
            if rank != me and not hmac.compare_digest(tag, tag_of(key, label, world_size, rank, nonces))]
