"""Assemble one networked engine of a role: ROUTER on `--listen` (a CURVE server behind the
engine's `LinkGuard`), transport, role steps, loop."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from kvseal.disagg.args import DEFAULT_DRAIN_S, DEFAULT_KV_TRANSPORT, DEFAULT_RESERVATION_TIMEOUT_S, KV_TRANSPORTS
from kvseal.disagg.decode import DecodeSteps
from kvseal.disagg.link_auth import LinkGuard
from kvseal.disagg.link_keys import KEYS_HINT, EngineLinkKeys, load_key_pair, load_public_keys
from kvseal.disagg.msgs import EngineInfoMsg, Role
from kvseal.disagg.prefill import PrefillSteps
from kvseal.disagg.role import Replies, RoleSteps
from kvseal.disagg.router_link import IDLE_POLL_MS, RouterLink
from kvseal.disagg.stream import StreamReceiver, StreamSender
from kvseal.disagg.tcp import TcpReceiver, TcpSender
from kvseal.disagg.transport import KVReceiver, KVSender
from kvseal.disagg.wire import PeerLinks, tcp_endpoint
from kvseal.engine.engine import LLMEngine
from kvseal.engine.loop import EngineLoop
from kvseal.errors import ConfigError

logger = logging.getLogger("kvseal.disagg")


@dataclass(frozen=True)
class NodeConfig:
    role: Role
    listen: str  # HOST:PORT, bound exactly
    kv_transport: str = DEFAULT_KV_TRANSPORT
    reservation_timeout_s: float = DEFAULT_RESERVATION_TIMEOUT_S
    # nixl: how long decode waits, after cancelling a transfer neither NIXL nor prefill confirmed
    # over, before it releases the pages (NIXL cannot cancel a write in flight)
    transfer_drain_s: float = DEFAULT_DRAIN_S
    # torch's CPU threads in this engine; None keeps torch's default (one per core). Two engines
    # on one host must split the cores: each running one thread per core oversubscribes them,
    # and torch's OpenMP workers then wait at every op's barrier for a thread that is off-CPU.
    num_threads: int | None = None
    # I9: the engine's own key pair and who may talk to it (frontends; on decode, prefill peers)
    link_keys: EngineLinkKeys = field(kw_only=True)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ConfigError(f"--role must be prefill or decode, got {self.role!r}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ConfigError(f"--kv-transport must be one of {', '.join(KV_TRANSPORTS)}, got {self.kv_transport!r}")
        if self.transfer_drain_s < 0:
            raise ConfigError(f"transfer_drain_s must be >= 0, got {self.transfer_drain_s}")
        if self.reservation_timeout_s <= 0:
            raise ConfigError(f"--reservation-timeout-s must be > 0, got {self.reservation_timeout_s}")
        if self.role == "prefill" and self.link_keys.peers:
            raise ConfigError("--peer-keys applies to --role decode only: a prefill engine takes messages from "
                              "frontends only (give the prefill engines' public keys to the decode engines)")
        if self.role == "decode" and not self.link_keys.peers:
            raise ConfigError(f"a decode engine needs --peer-keys PATH[,PATH...]: the public keys of the prefill "
                              f"engines that may send it KV and commits; {KEYS_HINT}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.num_threads}; leave it unset for one per core")
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--listen must be HOST:PORT with a port in 1..65535, got {self.listen!r}")


def node_config_from(ns: argparse.Namespace) -> NodeConfig:
    return NodeConfig(ns.role, ns.listen, ns.kv_transport, ns.reservation_timeout_s, num_threads=ns.threads,
                      link_keys=link_keys_from(ns))


def link_keys_from(ns: argparse.Namespace) -> EngineLinkKeys:
    """`--link-key`, `--frontend-keys`, `--peer-keys`: required on every address, loopback too
    (any local process can reach a loopback port)."""
    if not ns.link_key or not ns.frontend_keys:
        peers = " and --peer-keys PATH[,PATH...] (the prefill engines' public keys)" if ns.role == "decode" else ""
        raise ConfigError(f"kvseal engine (listening on {ns.listen}) needs keys: every engine link is authenticated "
                          f"with CurveZMQ, on loopback too. Give --link-key FILE (this engine's NAME.key_secret), "
                          f"--frontend-keys PATH[,PATH...] (the public keys of the frontends that may use it){peers}; "
                          f"{KEYS_HINT}")
    peers_spec = getattr(ns, "peer_keys", None)
    return EngineLinkKeys(load_key_pair(ns.link_key), load_public_keys(ns.frontend_keys, "--frontend-keys"),
                          load_public_keys(peers_spec, "--peer-keys") if peers_spec else ())


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
        self.engine = engine
        self.config = config
        self.ctx = ctx or zmq.Context()
        self.instance_id = f"{config.role}-{config.listen}-{secrets.token_hex(4)}"
        self.guard = LinkGuard(self.ctx, config.link_keys, f"kvseal-{self.instance_id}")
        self.router = self._bind()
        self.links = PeerLinks(self.ctx, config.link_keys.own)
        replies = Replies(self.router)
        self.steps = self._steps(replies)
        self.link = RouterLink(engine, self.steps, self.router, replies, self._info(), self.guard)
        self.loop = EngineLoop(engine, self.link, self.steps, IDLE_POLL_MS)

    def check_integrity(self) -> None:
        """For tests: the engine's invariants, with the role's held requests (reservations)."""
        self.link.check_integrity()

    def _bind(self) -> zmq.Socket:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 1000)
        self.guard.secure_server(router)  # before bind: no connection is ever plain
        try:
            router.bind(tcp_endpoint(self.config.listen))
        except zmq.ZMQError as exc:
            router.close(linger=0)
            self.guard.close()
            raise ConfigError(f"cannot listen on {self.config.listen}: {exc}; give --listen an IP address of this "
                              f"host and a free port") from exc
        return router

    def _steps(self, replies: Replies) -> RoleSteps:
        if self.config.role == "decode":
            self.transport: KVReceiver | KVSender = self._receiver()
            return DecodeSteps(self.engine, self.transport, replies, self.config.reservation_timeout_s,
                               self.instance_id)
        self.transport = self._sender()
        return PrefillSteps(self.engine, self.transport, self.links, replies, self.instance_id)

    def _receiver(self) -> KVReceiver:
        pool, host = self.engine.kv.pool, self.config.listen.rpartition(":")[0]
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
        self.router.close(linger=0)
        self.guard.close()
