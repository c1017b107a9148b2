"""Fixtures of the ops tests.

The Triton kernels run here on CPU tensors under Triton's interpreter; tests/conftest.py switches
it on before anything imports triton (see there why it cannot wait for this folder).
"""

from built_kernels import tile_engine  # noqa: F401  (a fixture)
