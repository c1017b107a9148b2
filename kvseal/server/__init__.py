"""OpenAI-compatible multi-tenant HTTP frontend (`kvseal serve`).

Importing this package is cheap (the CLI adds the serve flags for every command); the
server itself is loaded only when `serve` runs.
"""

from __future__ import annotations

import argparse

from kvseal.server.config import add_serve_arguments

__all__ = ["add_serve_arguments", "serve"]


def serve(ns: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT; returns the process exit status."""
    from kvseal.server.main import run

    return run(ns)
