"""The colocated engine process: load the model, say ready (or why not), then run its loop.

Started by the frontend with multiprocessing's "spawn" context (torch and fork do not mix).
It ignores SIGINT and SIGTERM (the frontend decides when it stops, with `ShutdownMsg`, so a
signal to the whole process group drains like one to the frontend), and SIGHUP (the frontend's
"reload the API keys"; an engine has none) and exits on its own
when the frontend process disappears (then it also removes the frontend's socket folder, which
nothing else is left to remove). Exit status 0 after a shutdown, 1 on any failure, which it
reports first with `EngineFailedMsg` when it still can.

From its first moment to its exit a thread says `EngineAliveMsg` every `HEARTBEAT_S` on a
socket of its own, so the frontend hears the process while it loads, idles or runs one long
step (a big prefill on a slow host), and hears nothing once it is stopped (SIGSTOP), frozen,
or wedged holding the interpreter lock: the frontend kills a process silent for
`--engine-timeout-s` and restarts it as one that crashed. The heartbeat comes from a thread,
not from the loop between steps, because no bound on one step's length would be safe on every
host; a loop blocked off the lock (a collective waiting on a lost rank) is `--tp-timeout`'s.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from kvseal.config import EngineArgs
from kvseal.kvcache.reserve import reserve_cpu_pool
from kvseal.messages.codec import encode
from kvseal.messages.convert import stats_to_msg
from kvseal.messages.msgs import TP_RANK_LOST, EngineAliveMsg, EngineFailedMsg, EngineReadyMsg

if TYPE_CHECKING:
    from kvseal.engine.engine import LLMEngine

logger = logging.getLogger("kvseal.engine")

SEND_TIMEOUT_MS = 30_000  # a frontend that reads nothing for this long is gone: exit
LINGER_MS = 5_000
HEARTBEAT_S = 0.5  # how often the engine says it is alive; --engine-timeout-s must be well above it


@dataclass(frozen=True)
class EngineAddresses:
    """ZMQ endpoints; the frontend binds both, the engine connects. `folder`: the private folder
    that holds them, which the engine removes if it outlives the frontend."""

    to_engine: str
    from_engine: str
    folder: str | None = None


def run_engine_process(args: EngineArgs, addresses: EngineAddresses, log_level: str) -> None:
    """Process entry point (must stay importable at module level for spawn)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if addresses.folder is not None:  # the engine's own scratch (a rank group's file store) goes in the
        tempfile.tempdir = addresses.folder  # frontend's private folder: removed with it, by whoever outlives
    ctx = zmq.Context()
    inbox, outbox = _connect(ctx, addresses)
    stop_heartbeat = threading.Event()
    heartbeat = threading.Thread(target=_heartbeat, args=(ctx, addresses.from_engine, stop_heartbeat),
                                 name="kvseal-engine-heartbeat", daemon=True)
    heartbeat.start()
    try:
        sys.exit(_serve(args, inbox, outbox))
    finally:
        stop_heartbeat.set()
        heartbeat.join()  # its socket is closed before the context ends
        inbox.close(linger=0)
        outbox.close(linger=LINGER_MS)
        parent = multiprocessing.parent_process()
        if addresses.folder is not None and parent is not None and not parent.is_alive():
            shutil.rmtree(addresses.folder, ignore_errors=True)  # a killed frontend removes nothing
        ctx.term()


def _connect(ctx: zmq.Context, addresses: EngineAddresses) -> tuple[zmq.Socket, zmq.Socket]:
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(addresses.to_engine)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    outbox.connect(addresses.from_engine)
    return inbox, outbox


def _heartbeat(ctx: zmq.Context, address: str, stop: threading.Event) -> None:
    """Say alive every `HEARTBEAT_S` until `stop`, on a socket of this thread's own (a ZMQ socket
    is never shared between threads). A beat the frontend is not reading is dropped, not queued."""
    socket = ctx.socket(zmq.PUSH)
    try:
        socket.setsockopt(zmq.SNDHWM, 1)
        socket.connect(address)
        alive = encode(EngineAliveMsg())
        while not stop.wait(HEARTBEAT_S):
            try:
                socket.send(alive, zmq.NOBLOCK)
            except zmq.Again:
                pass
    finally:
        socket.close(linger=0)


def _serve(args: EngineArgs, inbox: zmq.Socket, outbox: zmq.Socket) -> int:
    # The pool's memory first, before the imports below load torch: committing it is most of a
    # cold start (`kvseal.kvcache.reserve`); the engine adopts it or releases it.
    reservation = reserve_cpu_pool(args)
    from kvseal.engine.colocated import colocated_loop
    from kvseal.engine.engine import LLMEngine
    from kvseal.heap import freeze_startup_heap

    try:
        engine = LLMEngine(args, pool_reservation=reservation)
        # the pool's figures before ready: /metrics has them from start-up, not after a first request
        outbox.send(encode(stats_to_msg(engine.stats())))
        outbox.send(encode(_ready_msg(engine)))
    except Exception as exc:  # any start-up failure is reported, typed, to the frontend
        logger.error("engine start-up failed: %s", exc)
        outbox.send(encode(EngineFailedMsg(type(exc).__name__, str(exc))))
        return 1
    freeze_startup_heap("engine")
    parent = multiprocessing.parent_process()
    try:
        colocated_loop(engine, inbox, outbox, parent.sentinel if parent is not None else None).run()
    except Exception as exc:
        logger.exception("engine loop failed; every in-flight request fails with it")
        outbox.send(encode(EngineFailedMsg(type(exc).__name__, loop_failure(exc))))
        return 1
    return 0


def loop_failure(exc: Exception) -> str:
    """What the frontend tells clients (responses, stream error events, /health) of a failed
    engine loop: a plain reason. The exception itself, with the paths, ports and PIDs it may
    name (gloo's are all three), is in the engine's log just above."""
    from kvseal.parallel.group import RankFailure  # loaded with the engine already

    if isinstance(exc, RankFailure):
        return TP_RANK_LOST
    return "the engine loop failed; the details are in the server log"


def _ready_msg(engine: LLMEngine) -> EngineReadyMsg:
    path = Path(engine.loaded.path)
    return EngineReadyMsg(
        pid=os.getpid(), model_name=engine.loaded.name, model_path=str(path),
        tokenizer_path=str(engine.loaded.tokenizer_path),
        architecture=engine.model_config.architecture, max_model_len=engine.limits.max_model_len,
        kv_cache_tokens=engine.limits.kv_cache_tokens, vocab_size=engine.limits.vocab_size,
        page_size=engine.cache_config.page_size, num_pages=engine.cache_config.num_pages,
        kv_scrub_policy=engine.cache_config.scrub_policy,
    )
