"""uvicorn, with kvseal's signal handling, drain, header timeout and start and stop hooks.

- After the listening socket is bound, the ready line is logged (with the real port).
- When shutdown begins (SIGTERM/SIGINT), the app drains first, with the listener still open:
  new connections are answered (503 while draining) rather than refused, and in-flight
  requests get the grace period. Only then does uvicorn stop accepting connections and give
  what is left `timeout_graceful_shutdown` seconds.
- uvicorn re-raises the captured signal after a graceful shutdown, which would end the
  process with -SIGTERM; kvseal handles the signal itself and exits 0 instead.
- A connection whose request headers have not all arrived `header_timeout_s` after its
  first byte (or after it opened) is closed: slow clients cannot hold connections forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class KvsealServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_started: Callable[[int], None],
                 drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._on_started = on_started
        self._drain = drain

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        await super().startup(sockets)
        if self.started and self.servers:
            self._on_started(self.servers[0].sockets[0].getsockname()[1])

    async def shutdown(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        await self._drain()  # the listener stays open meanwhile
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def h11_protocol_with_header_timeout(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing connections whose request headers arrive too slowly."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._is_awaiting_headers():
                self._arm_header_timer()  # a keep-alive connection's next request started
            else:
                self._disarm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _is_awaiting_headers(self) -> bool:
            return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._on_header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            if self._is_awaiting_headers():
                self.transport.close()

    return HeaderTimeoutProtocol
