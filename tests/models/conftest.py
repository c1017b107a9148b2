"""Fixtures shared by the model tests."""

from built_kernels import tile_engine  # noqa: F401  (a fixture)
