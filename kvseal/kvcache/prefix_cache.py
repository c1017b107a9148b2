"""Prefix-cache keys (I5): a full page is named by (namespace, chained hash of its tokens).

The chained hash of page i covers its own tokens and, through the hash of page i - 1, every
earlier token: equal hashes mean equal whole prefixes, not just equal pages. The namespace
is derived from the request's tenant by the engine (`kvseal.types.namespace_of`, I5), never
from a client field or a message, so a key of one tenant can never equal a key of another.
"""

from __future__ import annotations

import hashlib
from array import array

from kvseal._testing.faults import Fault, is_active
from kvseal.types import namespace_of

__all__ = ["PageKey", "extend_page_hashes", "namespace_of", "page_key"]

PageKey = tuple[str, bytes]  # (namespace, chained page hash)


def page_key(namespace: str, page_hash: bytes) -> PageKey:
    if is_active(Fault.DROP_CACHE_NAMESPACE):
        return "", page_hash  # test-only: the namespace is dropped from the key
    return namespace, page_hash


def extend_page_hashes(hashes: list[bytes], token_ids: list[int], page_size: int, num_pages: int) -> None:
    """Grow `hashes` (the chained hashes of the leading full pages of `token_ids`) in place
    to cover the first `num_pages` pages. Needs `num_pages * page_size <= len(token_ids)`."""
    assert num_pages * page_size <= len(token_ids), "only full pages have a hash"
    parent = hashes[-1] if hashes else b""
    for i in range(len(hashes), num_pages):
        tokens = array("q", token_ids[i * page_size:(i + 1) * page_size]).tobytes()
        parent = hashlib.sha256(len(parent).to_bytes(1, "big") + parent + tokens).digest()
        hashes.append(parent)
