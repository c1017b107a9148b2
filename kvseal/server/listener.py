"""The server's listening socket, bound before any engine starts.

An address that cannot be listened on (a port another process holds, a host that does not
resolve or is not this machine's) then stops start-up at once with a `kvseal: error:` naming
it, instead of after the model has loaded. The socket is bound but not listening: until the
server is ready, connections are refused as before; uvicorn listens on it once the engine is
ready (`kvseal.server.main`). Cheap: imports nothing of the HTTP server.
"""

from __future__ import annotations

import socket

from kvseal.errors import ConfigError


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), port 0 meaning a free one; the caller closes it.
    Refuses (ConfigError) an address that does not resolve or cannot be bound."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except OSError as exc:
        raise _cannot_listen(host, port, exc) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own bind: TIME_WAIT is no obstacle
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise _cannot_listen(host, port, exc) from None
    return sock


def _cannot_listen(host: str, port: int, exc: OSError) -> ConfigError:
    reason = exc.strerror or str(exc)
    return ConfigError(f"cannot listen on {host}:{port}: {reason}; give a --host of this machine (e.g. 127.0.0.1 "
                       f"or 0.0.0.0) and a free --port (0 picks one)")
