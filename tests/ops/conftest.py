"""Fixtures of the ops tests."""

from built_kernels import tile_engine  # noqa: F401  (a fixture)
