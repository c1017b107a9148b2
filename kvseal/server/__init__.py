"""OpenAI-compatible multi-tenant HTTP frontend (`kvseal serve`).

Importing this package is cheap (the CLI adds the serve flags for every command); the
server itself is loaded only when `serve` runs. The server knows its engines only through
`kvseal.engine_api.EngineBackend`; the command line picks the backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvseal.server.config import ServerConfig, add_serve_arguments

if TYPE_CHECKING:
    from kvseal.engine_api import EngineBackend

__all__ = ["ServerConfig", "add_serve_arguments", "serve"]


def serve(config: ServerConfig, make_backend: Callable[[], EngineBackend]) -> int:
    """Run the server over the backend `make_backend` makes, until SIGTERM/SIGINT; returns the
    process exit status."""
    from kvseal.server.main import run

    return run(config, make_backend)
