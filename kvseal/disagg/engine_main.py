"""`kvseal engine --role prefill|decode --listen HOST:PORT`: one networked engine.

It loads the model, binds exactly `--listen`, logs "ready", and serves frontends and peer
engines until SIGTERM/SIGINT (or, when started by `kvseal serve --pd`, until its parent
exits): then it aborts what it holds (reservations are released under the usual rule) and
exits 0. A configuration it cannot honour (I2) stops it with exit status 2 before it binds.
With `-tp N` it drives N ranks (`kvseal/parallel/`, the handoff: `parallel/handoff.py`); a rank
that dies or hangs (`RankFailure`) ends every request it holds as lost with the engine (code
`engine_unavailable`: the client gets 503, the audit an error), and it exits 1.
Any other error that ends the loop propagates (traceback, exit status 1) once every socket is
closed without lingering: the process never stays alive serving nothing, so a supervisor
restarts it.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import signal
from collections.abc import Callable
from types import FrameType

import torch

from kvseal.config import EngineArgs
from kvseal.disagg.config import NodeConfig
from kvseal.disagg.node import EngineNode
from kvseal.engine.engine import LLMEngine
from kvseal.heap import freeze_startup_heap
from kvseal.messages.msgs import TP_RANK_LOST
from kvseal.parallel.group import RankFailure
from kvseal.types import ENGINE_UNAVAILABLE

logger = logging.getLogger("kvseal.disagg")


def serve_engine(args: EngineArgs, config: NodeConfig, should_stop: Callable[[], bool] = lambda: False) -> int:
    """Run one engine node until a signal or `should_stop()`; returns the exit status."""
    stop = {"signal": 0}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the frontend's "reload the API keys": sent to a group, not a stop
    if config.num_threads is not None:  # the engine sets torch's threads before any model work
        args = dataclasses.replace(args, num_threads=config.num_threads)
    node = EngineNode(LLMEngine(dataclasses.replace(args, pd_role=True)), config)
    freeze_startup_heap(f"engine ({config.role})")
    keys = config.link_keys
    logger.info("kvseal engine ready: role=%s listening on %s (instance %s, kv transport %s, reservation "
                "timeout %g s, keepalive every %g s, torch threads %d); CURVE key %s (public %s), accepting frontends "
                "%s and peers %s",
                config.role, config.listen, node.instance_id, config.kv_transport, config.reservation_timeout_s,
                config.keepalive_interval_s,
                torch.get_num_threads(), keys.own.name, keys.own.public.decode(),
                ",".join(k.name for k in keys.frontends), ",".join(k.name for k in keys.peers) or "(none)")
    status = 0
    try:
        while not stop["signal"] and not should_stop() and node.loop.run_once():
            node.engine.check_ranks()  # a tensor-parallel rank lost while idle fails the engine now
        if not node.loop.is_stopped:
            end_on_shutdown(node)
    except RankFailure as exc:  # fail closed: every held request ends with an error, then exit
        end_on_rank_failure(node, exc)
        status = 1
    finally:  # also when the loop died of an unexpected error: the process must exit, not hang
        try:
            node.close()
        finally:  # closes what `close` did not (a socket an error left open), where `term()` would wait forever
            node.ctx.destroy(linger=0)
    logger.info("kvseal engine (%s) stopped", config.role)
    return status


def end_on_shutdown(node: EngineNode) -> None:
    """The engine was told to stop (SIGTERM, SIGINT, its `serve --pd` parent gone): every request
    it holds ends as lost with the engine (`ENGINE_UNAVAILABLE`: 503 `engine_unavailable`, the
    audit an error), which a client may retry on another engine, never as a refusal of the
    request (prefill's used to reach clients as 500 `request_aborted`, audited as rejected)."""
    node.steps.abort_all(f"the {node.config.role} engine is shutting down", ENGINE_UNAVAILABLE)


def end_on_rank_failure(node: EngineNode, exc: RankFailure) -> None:
    """A tensor-parallel rank died or hung: stop the ranks, and end every request the engine
    holds as lost with it (`ENGINE_UNAVAILABLE`: clients get 503 `engine_unavailable`, the audit
    an error, as for a dead engine process), with the plain reason; the error is logged here."""
    logger.error("kvseal engine (%s): a tensor-parallel rank failed: %s; aborting every request", node.config.role,
                 exc)
    node.engine.close()  # stops the ranks (by PID) and the grammar workers
    node.steps.abort_all(TP_RANK_LOST, ENGINE_UNAVAILABLE)


def run_engine_process(args: EngineArgs, config: NodeConfig, log_level: str) -> None:
    """Spawn entry point for `kvseal serve --pd`: exits when its parent does."""
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[{config.role}]: %(message)s")
    parent = multiprocessing.parent_process()
    raise SystemExit(serve_engine(args, config, lambda: parent is not None and not parent.is_alive()))
