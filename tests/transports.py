"""The KV transports the PD tests run over. NIXL is an optional extra (`pip install 'kvseal[nixl]'`,
which the README's test command installs): without it its cases skip, saying why."""

from __future__ import annotations

import importlib.util

import pytest

HAS_NIXL = importlib.util.find_spec("nixl") is not None
needs_nixl = pytest.mark.skipif(not HAS_NIXL, reason="nixl is not installed: pip install 'kvseal[nixl]'")
NIXL = pytest.param("nixl", marks=needs_nixl)
