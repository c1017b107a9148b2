"""The colocated engine process: load the model, say ready (or why not), then run its loop.

Started by the frontend with multiprocessing's "spawn" context (torch and fork do not mix).
It ignores SIGINT and SIGTERM (the frontend decides when it stops, with `ShutdownMsg`, so a
signal to the whole process group drains like one to the frontend), and SIGHUP (the frontend's
"reload the API keys"; an engine has none) and exits on its own
when the frontend process disappears (then it also removes the frontend's socket folder, which
nothing else is left to remove). Exit status 0 after a shutdown, 1 on any failure, which it
reports first with `EngineFailedMsg` when it still can.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from kvseal.config import EngineArgs
from kvseal.kvcache.reserve import reserve_cpu_pool
from kvseal.messages.codec import encode
from kvseal.messages.msgs import EngineFailedMsg, EngineReadyMsg

if TYPE_CHECKING:
    from kvseal.engine.engine import LLMEngine

logger = logging.getLogger("kvseal.engine")

SEND_TIMEOUT_MS = 30_000  # a frontend that reads nothing for this long is gone: exit
LINGER_MS = 5_000


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
    try:
        sys.exit(_serve(args, inbox, outbox))
    finally:
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


def _serve(args: EngineArgs, inbox: zmq.Socket, outbox: zmq.Socket) -> int:
    # The pool's memory first, before the imports below load torch: committing it is most of a
    # cold start (`kvseal.kvcache.reserve`); the engine adopts it or releases it.
    reservation = reserve_cpu_pool(args)
    from kvseal.engine.colocated import colocated_loop
    from kvseal.engine.engine import LLMEngine
    from kvseal.heap import freeze_startup_heap

    try:
        engine = LLMEngine(args, pool_reservation=reservation)
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
        outbox.send(encode(EngineFailedMsg(type(exc).__name__, f"engine loop failed: {exc}")))
        return 1
    return 0


def _ready_msg(engine: LLMEngine) -> EngineReadyMsg:
    from kvseal.models.loader import convert_gguf

    path = Path(engine.loaded.path)
    tokenizer_path = convert_gguf(path) if path.suffix == ".gguf" else path
    return EngineReadyMsg(
        pid=os.getpid(), model_name=engine.loaded.name, model_path=str(path), tokenizer_path=str(tokenizer_path),
        architecture=engine.model_config.architecture, max_model_len=engine.limits.max_model_len,
        kv_cache_tokens=engine.limits.kv_cache_tokens, vocab_size=engine.limits.vocab_size,
        page_size=engine.cache_config.page_size, num_pages=engine.cache_config.num_pages,
        kv_scrub_policy=engine.cache_config.scrub_policy,
    )
