"""Paged KV cache: allocator (ownership, I3), pool (tensors and write records), manager."""

from kvseal.kvcache.allocator import OutOfPages, PageAllocator, PageOwner
from kvseal.kvcache.manager import KVCacheManager
from kvseal.kvcache.pool import KVPool

__all__ = ["KVCacheManager", "KVPool", "OutOfPages", "PageAllocator", "PageOwner"]
