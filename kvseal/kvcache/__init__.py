"""Paged KV cache: allocator (ownership, I3), pool (tensors), write records (I3/I4), manager.

Import the module you need (`kvseal.kvcache.pool` for the tensors alone): this package imports
nothing, so model code that reads the pool does not load the allocator.
"""
