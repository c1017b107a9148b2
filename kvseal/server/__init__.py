"""OpenAI-compatible multi-tenant HTTP frontend (`kvseal serve`).

Importing this package is cheap (the CLI adds the serve flags for every command); the
server itself is loaded only when `serve` runs. The server knows its engines only through
`kvseal.engine_api.EngineBackend`; the command line picks the backend.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvseal.server.config import ServerConfig, add_serve_arguments
from kvseal.server.listener import bind_listener

if TYPE_CHECKING:
    from kvseal.engine_api import EngineBackend
    from kvseal.server.files import FrontDoorFiles

__all__ = ["ServerConfig", "add_serve_arguments", "bind_listener", "open_front_door", "serve"]


def open_front_door(config: ServerConfig) -> FrontDoorFiles:
    """The API keys and the audit log, read and opened before any engine starts: a bad keys file
    or an audit log that cannot be opened stops start-up first (ConfigError). Cheap: none of the
    HTTP server's modules load."""
    from kvseal.server.files import FrontDoorFiles

    return FrontDoorFiles.open(config)


def serve(config: ServerConfig, make_backend: Callable[[], EngineBackend], listener: socket.socket,
          files: FrontDoorFiles | None = None) -> int:
    """Run the server over the backend `make_backend` makes, until SIGTERM/SIGINT; returns the
    process exit status. `listener`: from `bind_listener`, bound to config's host and port before
    any engine started (the caller closes it). `files`: from `open_front_door` (opened here if
    None); closed here."""
    files = files if files is not None else open_front_door(config)
    try:
        from kvseal.server.main import run

        return run(config, make_backend, listener, files)
    finally:
        files.audit.close()
