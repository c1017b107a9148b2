"""`kvseal serve`: start the engine backend, wait until it is ready, then serve HTTP.

The backend (`kvseal.engine_api.EngineBackend`: the colocated engine process, or PD engines)
is made by the caller (`kvseal.cli`); this module knows only its interface.
Start-up order: read the keys file and open the audit log (bad ones stop start-up), make
the backend and start it (its configuration errors, I2, stop start-up with their own message), load the
tokenizer the engine reports, log the resolved configuration, listen on the socket the caller
bound before any engine started (`kvseal.server.listener`), log "ready". Shutdown
(SIGTERM/SIGINT): refuse new requests with 503 (the listener stays open, so new connections
get that answer), give in-flight ones the grace period, then abort the rest in the engine
(their clients get an error, never a fake finish), stop the engine, exit 0. The engine
process ignores SIGTERM and SIGINT and stops only on the frontend's `ShutdownMsg`, so a
signal to the whole process group (systemd, `kill -TERM -PGID`, `tini -g`) drains the same
way as one to the frontend alone. A signal once the engine is stopping is logged and ignored
(`_StopSignals`). SIGHUP, once the server is ready, reloads the keys file
(`kvseal.server.admin`; the engines ignore it); before that it is logged and ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import uvicorn
import uvloop

from kvseal.engine_api import EngineBackend
from kvseal.errors import ConfigError
from kvseal.generation_defaults import GenerationDefaults
from kvseal.heap import freeze_startup_heap
from kvseal.messages.msgs import ABORT_SERVER_SHUTDOWN
from kvseal.server.admin import reload_keys_on_signal
from kvseal.server.app import build_app
from kvseal.server.config import ServerConfig
from kvseal.server.files import FrontDoorFiles
from kvseal.server.metrics import ServerMetrics
from kvseal.server.open_files import connection_cap, raise_open_files_limit
from kvseal.server.prompts import PromptEncoder
from kvseal.server.reasoning import reasoning_markers
from kvseal.server.state import AppState
from kvseal.server.uvicorn_server import KvsealServer, protocol_with_header_timeout

logger = logging.getLogger("kvseal.server")

ABORT_MARGIN_S = 10.0  # after the grace period: time for aborted requests to send their errors
_DRAIN_POLL_S = 0.05
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run(config: ServerConfig, make_backend: Callable[[], EngineBackend], listener: socket.socket,
        files: FrontDoorFiles) -> int:
    """Serve until SIGTERM/SIGINT; `make_backend` is called in the event loop (a backend may
    start engine processes as it is made, or have started them already). `files`: the keys and
    audit log, in order (`kvseal.server.open_front_door`); the caller closes them."""
    if files.keys.is_open and not config.is_loopback:
        logger.warning("!" * 80)
        logger.warning("NO API KEYS and bound to %s: anyone who can reach this address can use the server "
                       "as tenant 'default'. Pass --api-keys FILE, or bind 127.0.0.1.", config.host)
        logger.warning("!" * 80)
    with _handlers_put_back(*_STOP_SIGNALS, signal.SIGHUP):
        return uvloop.run(_serve(config, make_backend, listener, files))


@contextlib.contextmanager
def _handlers_put_back(*signals: signal.Signals) -> Iterator[None]:
    """The event loop's signal handlers stay until it closes, which leaves the default actions
    (die at once): put back the ones that were there before (the `serve` command's)."""
    previous = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # (None: one not installed from Python, left as it is)
                signal.signal(sig, handler)


async def _serve(config: ServerConfig, make_backend: Callable[[], EngineBackend], listener: socket.socket,
                 files: FrontDoorFiles) -> int:
    metrics = ServerMetrics()
    loop = asyncio.get_running_loop()
    stop = _StopSignals(loop)
    loop.add_signal_handler(signal.SIGHUP, logger.warning, "SIGHUP before the server is ready: ignored; send it "
                            "again once the server logs 'kvseal ready' to reload the API keys")
    engine = make_backend()
    engine.on_stats = metrics.record_stats  # the engines' summed pools and load
    engine.add_metrics(metrics.registry)
    try:
        state = await _start(config, engine, files, metrics, stop.requested)
        if state is None:
            return 0  # stopped by a signal before the engine was ready
        freeze_startup_heap("frontend")
        # An engine restarted at the same address may bring other limits: the front door uses them (I1).
        engine.on_ready_change = lambda info: setattr(state, "engine_info", info)
        loop.add_signal_handler(signal.SIGHUP, reload_keys_on_signal, state)
        open_files = raise_open_files_limit()
        max_connections = connection_cap(config.max_connections, open_files)
        logger.info("max_connections=%d (open files allowed: %d)", max_connections, open_files)
        server = KvsealServer(_uvicorn_config(config, state, max_connections), lambda port: _log_ready(state, port),
                              lambda: _drain(state))
        stop.serving(server)
        try:
            await server.serve(sockets=[listener])
        finally:
            state.prompts.close()
            state.bodies.close()
        return 0
    finally:
        stop.stopping_engines()  # from here to the event loop's close
        await engine.shutdown()


class _StopSignals:
    """SIGTERM and SIGINT, from the event loop's start to its end, in one handler: before the
    engine is ready they stop start-up; while serving they begin uvicorn's shutdown (which drains
    first, for at most the grace period and the abort margin, whatever else comes); while the engines
    stop, they are logged and ignored, as that stop is bounded and must finish: a signal's default
    action there would end the frontend before it removed the engine's socket folder (SIGHUP's
    too, once it no longer reloads keys). So they stay until the event loop closes."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.requested = asyncio.Event()
        self._server: KvsealServer | None = None
        self._engines_stopping = False
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)

    def serving(self, server: KvsealServer) -> None:
        self._server = server
        if self.requested.is_set():  # a signal came between start-up and now: shut down at once
            server.handle_exit(signal.SIGTERM, None)

    def stopping_engines(self) -> None:
        self._engines_stopping = True
        self._loop.add_signal_handler(signal.SIGHUP, self._on_signal, signal.SIGHUP)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._engines_stopping:
            logger.info("%s while the engines stop: already stopping", sig.name)
            return
        self.requested.set()
        if self._server is not None:
            self._server.handle_exit(sig, None)


async def _start(config: ServerConfig, engine: EngineBackend, files: FrontDoorFiles, metrics: ServerMetrics,
                 stop: asyncio.Event) -> AppState | None:
    """Wait for the engine; a SIGTERM/SIGINT meanwhile (`stop`) stops start-up cleanly (returns None)."""
    starting = asyncio.ensure_future(engine.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not starting.done():
        logger.info("stopped before the engine was ready")
        starting.cancel()
        return None
    info = starting.result()
    prompts = await asyncio.to_thread(PromptEncoder.load, info.tokenizer_path, files.chat_template)
    try:
        defaults = GenerationDefaults.load(config.generation_config, _model_dir(info.model_path),
                                           config.generation_override)
        reasoning = reasoning_markers(config.reasoning_parser, prompts.tokenizer)
    except ConfigError:
        prompts.close()
        raise
    state = AppState(config, engine, info, prompts, files.keys, metrics, files.audit, defaults=defaults,
                     reasoning=reasoning)
    _log_config(state)
    return state


def _model_dir(model_path: str) -> Path | None:
    path = Path(model_path)
    return path if path.is_dir() else None


def _uvicorn_config(config: ServerConfig, state: AppState, max_connections: int) -> uvicorn.Config:
    http = protocol_with_header_timeout(config.header_timeout_s, max_connections)
    return uvicorn.Config(build_app(state), host=config.host, port=config.port, loop="none", http=http,
                          lifespan="off", log_config=None,
                          log_level=(config.uvicorn_log_level or config.log_level).lower(),
                          timeout_graceful_shutdown=math.ceil(ABORT_MARGIN_S))  # after _drain


def _log_config(state: AppState) -> None:
    c, info, limits = state.config, state.engine_info, state.limits
    tenants = ", ".join(t.describe() for t in state.keys.tenants)
    logger.info(
        "kvseal server: model=%s (%s, %s) max_model_len=%d kv_cache_tokens=%d (%d pages x %d) max_prompt_tokens=%d "
        "host=%s port=%d api_keys=%s tenants=[%s] audit_log=%s audit_log_max_bytes=%s audit_log_max_age_s=%s "
        "audit_log_backups=%s "
        "audit_log_prompts=%s max_body_bytes=%d "
        "shutdown_grace_s=%g header_timeout_s=%g body_timeout_s=%g (%s)",
        state.model_name, info.architecture, info.model_path, info.max_model_len, info.kv_cache_tokens,
        info.num_pages, info.page_size, limits.max_prompt_tokens, c.host, c.port, c.api_keys_path or "(none)",
        tenants, c.audit_log_path or "(kvseal.audit logger)", c.audit_log_max_bytes or "(no size limit)",
        c.audit_log_max_age_s or "(no age limit)",
        "(all kept)" if c.audit_log_backups is None else c.audit_log_backups, c.audit_log_prompts, c.max_body_bytes,
        c.shutdown_grace_s, c.header_timeout_s, c.body_timeout_s, state.engine.engine_pids,
    )
    logger.info("sampling defaults for omitted fields (--generation-config %s, --override-generation-config %s): %s",
                c.generation_config, c.override_generation_config or "(none)", state.defaults.describe())
    logger.info("chat template: %s",
                "the model's" if c.chat_template is None else f"--chat-template {c.chat_template!r}")


def _log_ready(state: AppState, port: int) -> None:
    logger.info("kvseal ready: serving %s at http://%s:%d/v1 (%s)", state.model_name,
                state.config.host, port, state.engine.engine_pids)


async def _drain(state: AppState) -> None:
    """Refuse new requests (503) and wait until the engine has ended every in-flight one: by
    itself within the grace period, or aborted after it (then at most `ABORT_MARGIN_S` more)."""
    state.is_draining = True
    logger.info("shutting down: refusing new requests; %d in flight get up to %g s", state.engine.num_in_flight,
                state.config.shutdown_grace_s)
    if await _until_idle(state, state.config.shutdown_grace_s):
        return
    logger.warning("grace period over: aborting %d in-flight requests", state.engine.num_in_flight)
    state.engine.abort_all(ABORT_SERVER_SHUTDOWN)
    await _until_idle(state, ABORT_MARGIN_S)


async def _until_idle(state: AppState, timeout_s: float) -> bool:
    """Whether the engine has no request in flight within `timeout_s` (bounded polling)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while state.engine.num_in_flight and loop.time() < deadline:
        await asyncio.sleep(_DRAIN_POLL_S)
    return not state.engine.num_in_flight
