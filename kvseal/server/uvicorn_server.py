"""uvicorn's server with kvseal's start and stop hooks.

- After the listening socket is bound, the ready line is logged (with the real port).
- When shutdown begins (SIGTERM/SIGINT), the app is told to drain before uvicorn stops
  accepting connections and gives in-flight requests `timeout_graceful_shutdown` seconds.
- uvicorn re-raises the captured signal after a graceful shutdown, which would end the
  process with -SIGTERM; kvseal handles the signal itself and exits 0 instead.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Generator

import uvicorn

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class KvsealServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_started: Callable[[int], None],
                 on_draining: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_started = on_started
        self._on_draining = on_draining

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        await super().startup(sockets)
        if self.started and self.servers:
            self._on_started(self.servers[0].sockets[0].getsockname()[1])

    async def shutdown(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        self._on_draining()
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
