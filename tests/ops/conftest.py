"""Fixtures of the ops tests.

The Triton kernels (the CUDA backend's) run here on CPU tensors under Triton's interpreter,
which Triton switches on when a kernel's module is imported with TRITON_INTERPRET=1: this file
is imported before any test module of this folder, so it sets the variable first.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

from built_kernels import tile_engine  # noqa: E402, F401  (a fixture)
