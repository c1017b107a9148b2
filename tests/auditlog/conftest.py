"""The server tests' helpers (a real `kvseal serve` on a tiny model) for the audit-log tools."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "server"))
