"""Assemble one networked engine of a role: ROUTER on `--listen` (a CURVE server behind the
engine's `LinkGuard`), transport, role steps, loop."""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

import zmq

from kvseal.disagg.config import NodeConfig
from kvseal.disagg.decode import DecodeSteps
from kvseal.disagg.frontend_watch import FrontendWatch
from kvseal.disagg.link_auth import LinkGuard
from kvseal.disagg.msgs import EngineInfoMsg
from kvseal.disagg.prefill import PrefillSteps
from kvseal.disagg.role import Replies, RoleSteps
from kvseal.disagg.router_link import IDLE_POLL_MS, RouterLink
from kvseal.disagg.sharded import StagedReceiver
from kvseal.disagg.stream import StreamReceiver, StreamSender
from kvseal.disagg.tcp import TcpReceiver, TcpSender
from kvseal.disagg.transport import KVReceiver, KVSender
from kvseal.disagg.wire import PeerLinks, tcp_endpoint
from kvseal.engine.engine import LLMEngine
from kvseal.engine.loop import EngineLoop
from kvseal.errors import ConfigError
from kvseal.kvcache.pool import KVPool
from kvseal.parallel.handoff import RankHandoff

logger = logging.getLogger("kvseal.disagg")


def kv_layout(engine: LLMEngine, kv_transport: str) -> str:
    """What must match between a prefill and a decode engine for KV to move between them."""
    m, c = engine.model_config, engine.cache_config
    return (f"{m.architecture}/layers={m.num_layers}/kv_heads={m.num_kv_heads}/head_dim={m.head_dim}/"
            f"dtype={str(c.dtype).removeprefix('torch.')}/page_size={c.page_size}/head-major/"
            f"transport={kv_transport}")


class EngineNode:
    """One engine of one role on the network; `loop.run()` serves until `ShutdownMsg`.

    The loop is every engine's (`EngineLoop`); the role adds its link (`RouterLink`: the
    ROUTER behind the `LinkGuard`) and its steps (`PrefillSteps` or `DecodeSteps`)."""

    def __init__(self, engine: LLMEngine, config: NodeConfig, ctx: zmq.Context | None = None) -> None:
        """`ctx`: this engine's own ZMQ context (its ZAP handler is the context's); a new one by default."""
        device = engine.kv.pool.device
        if device.type != "cpu" and config.kv_transport != "tcp-stream":  # before anything listens
            raise ConfigError(f"--kv-transport {config.kv_transport} moves KV straight out of a host pool; with the "
                              f"pool on {device} use --kv-transport tcp-stream (it stages KV through pinned host "
                              f"memory), or --device cpu")
        self.engine = engine
        self.config = config
        # tensor parallelism: rank 0 stages full pages for the transports (`parallel/handoff.py`), a
        # pool the KV budget paid for when the engine was sized for a PD role
        if engine.driver is not None and not engine.args.pd_role:
            raise ConfigError("a tensor-parallel engine serving a PD role stages full pages on rank 0, and its KV "
                              "budget must pay for them: build its EngineArgs with pd_role=True (kvseal engine does)")
        self.handoff = None if engine.driver is None else RankHandoff(engine.driver, engine.model_config, engine.kv)
        if self.handoff is not None:
            logger.info("tensor parallel, %s: rank 0 stages full pages for the PD wire: %d pages, %d bytes of host "
                        "memory, %s", config.role, self.handoff.wire.num_pages, self.handoff.wire.num_bytes,
                        "inside the KV budget" if device.type == "cpu" else "outside the GPU's KV budget")
        self.ctx = ctx or zmq.Context()
        self.instance_id = f"{config.role}-{config.listen}-{secrets.token_hex(4)}"
        self.guard = LinkGuard(self.ctx, config.link_keys, f"kvseal-{self.instance_id}")
        self.router = self._bind()
        self.links = PeerLinks(self.ctx, config.link_keys.own)
        replies = Replies(self.router)
        self.steps = self._steps(replies)
        self.link = RouterLink(engine, self.steps, self.router, replies, self._info(), self.guard,
                               FrontendWatch(config.frontend_timeout_s))
        self.loop = EngineLoop(engine, self.link, self.steps, IDLE_POLL_MS)

    def check_integrity(self) -> None:
        """For tests: the engine's invariants, with the role's held requests (reservations)."""
        self.link.check_integrity()

    def _bind(self) -> zmq.Socket:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 1000)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a closed connection fails: its frontend is gone
        self.guard.secure_server(router)  # before bind: no connection is ever plain
        try:
            router.bind(tcp_endpoint(self.config.listen))
        except zmq.ZMQError as exc:
            self.guard.monitor.close(linger=0)
            router.close(linger=0)
            self.guard.close()
            raise ConfigError(f"cannot listen on {self.config.listen}: {exc}; give --listen an IP address of this "
                              f"host and a free port") from exc
        return router

    def _steps(self, replies: Replies) -> RoleSteps:
        if self.config.role == "decode":
            receiver = self._receiver()
            self.transport: KVReceiver | KVSender = receiver
            return DecodeSteps(self.engine, receiver, replies, self.config.reservation_timeout_s,
                               self.instance_id, self.handoff)
        self.transport = self._sender()
        return PrefillSteps(self.engine, self.transport, self.links, replies, self.instance_id, self.config.link_keys,
                            self.handoff, keepalive_interval_s=self.config.keepalive_interval_s)

    def _receiver(self) -> KVReceiver:
        if self.handoff is None:
            return self._transport_receiver(self.engine.kv.pool)
        return StagedReceiver(self._transport_receiver(self.handoff.wire), self.handoff)

    def _transport_receiver(self, pool: KVPool) -> KVReceiver:
        host = self.config.listen.rpartition(":")[0]
        if self.config.kv_transport == "nixl":
            from kvseal.disagg.nixl import NixlReceiver  # imports nixl: only when asked for

            return NixlReceiver(pool, self.instance_id, host, self.config.transfer_drain_s)
        if self.config.kv_transport == "tcp-stream":
            return StreamReceiver(pool, self.engine.model_config.num_layers, host)
        return TcpReceiver(pool, self.engine.model_config.num_layers, self.config.listen)

    def _sender(self) -> KVSender:
        if self.config.kv_transport == "nixl":
            from kvseal.disagg.nixl import NixlSender

            return NixlSender(self.instance_id, self.config.listen.rpartition(":")[0])
        if self.config.kv_transport == "tcp-stream":
            return StreamSender()
        return TcpSender(self.links)

    def _info(self) -> EngineInfoMsg:
        e = self.engine
        return EngineInfoMsg(
            role=self.config.role, address=self.config.listen, instance_id=self.instance_id, pid=os.getpid(),
            model_name=e.loaded.name, model_path=str(Path(e.loaded.path)), architecture=e.model_config.architecture,
            max_model_len=e.limits.max_model_len, kv_cache_tokens=e.limits.kv_cache_tokens,
            vocab_size=e.limits.vocab_size, page_size=e.cache_config.page_size, num_pages=e.cache_config.num_pages,
            kv_layout=kv_layout(e, self.config.kv_transport), kv_transport=self.config.kv_transport,
            kv_scrub_policy=e.cache_config.scrub_policy,
        )

    def close(self) -> None:
        self.transport.close()
        self.links.close()
        self.guard.monitor.close(linger=0)
        self.router.close(linger=0)
        self.guard.close()
