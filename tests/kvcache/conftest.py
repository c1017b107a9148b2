"""Fixtures of the KV cache tests."""

from built_kernels import record_kernels  # noqa: F401  (a fixture)
