"""Paged KV cache: allocator (ownership, I3), pool (tensors), write records (I3/I4), manager."""

from kvseal.kvcache.allocator import OutOfPages, PageAllocator, PageOwner
from kvseal.kvcache.manager import KVCacheManager
from kvseal.kvcache.pool import KVPool
from kvseal.kvcache.records import ForwardWrites, WriteRecords

__all__ = ["ForwardWrites", "KVCacheManager", "KVPool", "OutOfPages", "PageAllocator", "PageOwner", "WriteRecords"]
