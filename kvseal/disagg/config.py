"""PD configuration: one engine node (`kvseal engine`), and a PD frontend's engines (`kvseal serve
--pd`, `--prefill/--decode`), as frozen dataclasses whose fields are the flags (`kvseal.flags`).
Cheap to import (no torch): the command line builds its parsers from it."""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass, field

from kvseal.disagg.link_keys import KEYS_HINT, EngineLinkKeys, load_key_pair, load_public_keys
from kvseal.disagg.msgs import Role
from kvseal.errors import ConfigError
from kvseal.flags import flag, values_of

DEFAULT_RESERVATION_TIMEOUT_S = 30.0
# How often a prefill engine tells decode it still holds a request (`TransferKeepaliveMsg`); far
# below any sensible --reservation-timeout-s, which must exceed it plus prefill's longest step.
DEFAULT_KEEPALIVE_INTERVAL_S = 1.0
# A frontend says hello every 0.5 s (`frontend.HEARTBEAT_S`); one whose connection is closed is
# noticed within a second whatever this is, so it only bounds a connection left open with nobody
# behind it, and must exceed the longest stall of a healthy frontend's event loop.
DEFAULT_FRONTEND_TIMEOUT_S = 30.0
MIN_FRONTEND_TIMEOUT_S = 2.0  # four heartbeats
DEFAULT_DRAIN_S = 5.0  # nixl: see NodeConfig.transfer_drain_s
# tcp: KV frames on the ZMQ link (tcp.py); tcp-stream: KV on a plain TCP stream of its own,
# received straight into decode's pages (stream.py); nixl: NIXL one-sided WRITEs over UCX (nixl.py)
KV_TRANSPORTS = ("tcp", "tcp-stream", "nixl")
# The default since it measured ~1.4x the ZMQ path's throughput at half its CPU (docs/BENCHMARKS.md)
DEFAULT_KV_TRANSPORT = "tcp-stream"
# `--link-key` of an engine and of a PD frontend: the process's own key pair
LINK_KEY = flag("this process's CURVE key pair (NAME.key_secret, mode 0600) from `kvseal keys generate`; every "
                "engine link is authenticated, loopback too (required by `kvseal engine` and by serve "
                "--prefill/--decode, whose keys the engines list in --frontend-keys; --pd makes throw-away keys)",
                metavar="FILE")


@dataclass(frozen=True)
class NodeConfig:
    role: Role = field(metadata=flag("prefill or decode", choices=("prefill", "decode")))
    listen: str = field(metadata=flag(  # HOST:PORT, bound exactly
        "the only address this engine binds (frontends and peer engines connect here)", metavar="HOST:PORT"))
    kv_transport: str = field(default=DEFAULT_KV_TRANSPORT, metadata=flag(
        "how prompt KV moves from prefill to decode (`kvseal engine`, on both roles, or `serve --pd`); nixl needs "
        "pip install 'kvseal[nixl]'", choices=KV_TRANSPORTS))
    reservation_timeout_s: float = field(default=DEFAULT_RESERVATION_TIMEOUT_S, metadata=flag(
        "decode releases a reservation after this long without a sign of its prefill: the deadline restarts at "
        "every keepalive prefill sends while it holds the request (queued or computing, about every second) and "
        "at every KV block that lands, so it catches a prefill that died, lost the request or hung in one step, "
        "never a slow one; keep it above prefill's longest step (`kvseal engine --role decode`, or `serve --pd`)"))
    frontend_timeout_s: float = field(default=DEFAULT_FRONTEND_TIMEOUT_S, metadata=flag(
        "the engine ends every request, prefill job and reservation of a frontend it has not heard from for this "
        "long (kvseal's frontend says hello every 0.5 s); one whose connection closed is ended at once"))
    # nixl: how long decode waits, after cancelling a transfer neither NIXL nor prefill confirmed
    # over, before it releases the pages (NIXL cannot cancel a write in flight)
    transfer_drain_s: float = DEFAULT_DRAIN_S
    # prefill: the longest gap between two `TransferKeepaliveMsg` of one held request (between engine steps)
    keepalive_interval_s: float = DEFAULT_KEEPALIVE_INTERVAL_S
    # torch's CPU threads in this engine; None keeps torch's default (one per core). Two engines
    # on one host must split the cores: each running one thread per core oversubscribes them,
    # and torch's OpenMP workers then wait at every op's barrier for a thread that is off-CPU.
    # (`kvseal engine --threads`, which is `EngineArgs.num_threads`'s flag; `serve --pd-threads`.)
    num_threads: int | None = None
    # I9: the engine's own key pair and who may talk to it (frontends; on decode, prefill peers)
    link_keys: EngineLinkKeys = field(kw_only=True)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ConfigError(f"--role must be prefill or decode, got {self.role!r}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ConfigError(f"--kv-transport must be one of {', '.join(KV_TRANSPORTS)}, got {self.kv_transport!r}")
        if self.kv_transport == "nixl" and importlib.util.find_spec("nixl") is None:
            raise ConfigError("--kv-transport nixl needs the nixl package, an optional extra: pip install "
                              "'kvseal[nixl]' (or use the built-in tcp-stream transport, the default)")
        if self.transfer_drain_s < 0:
            raise ConfigError(f"transfer_drain_s must be >= 0, got {self.transfer_drain_s}")
        if not self.keepalive_interval_s > 0:
            raise ConfigError(f"keepalive_interval_s must be > 0, got {self.keepalive_interval_s}")
        if self.reservation_timeout_s <= 0:
            raise ConfigError(f"--reservation-timeout-s must be > 0, got {self.reservation_timeout_s}")
        if not self.frontend_timeout_s >= MIN_FRONTEND_TIMEOUT_S:
            raise ConfigError(f"--frontend-timeout-s must be >= {MIN_FRONTEND_TIMEOUT_S:g} (a frontend says hello "
                              f"every 0.5 s; below a few of those a healthy one would be ended), got "
                              f"{self.frontend_timeout_s}")
        if self.role == "prefill" and self.link_keys.peers:
            raise ConfigError("--peer-keys applies to --role decode only: a prefill engine takes messages from "
                              "frontends only (give the prefill engines' public keys to the decode engines)")
        if self.role == "decode" and not self.link_keys.peers:
            raise ConfigError(f"a decode engine needs --peer-keys PATH[,PATH...]: the public keys of the prefill "
                              f"engines that may send it KV and commits; {KEYS_HINT}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.num_threads}; leave it unset for one per core")
        host, _, port = self.listen.rpartition(":")
        if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            raise ConfigError(f"--listen must be HOST:PORT with a port in 1..65535, got {self.listen!r}")


@dataclass(frozen=True)
class EngineKeyFiles:
    """`kvseal engine`'s key files (I9): its own pair and who may talk to it."""

    link_key: str | None = field(default=None, metadata=LINK_KEY)
    frontend_keys: str | None = field(default=None, metadata=flag(
        "required: public keys (NAME.key files, or folders of them) of the frontends allowed to use this engine; "
        "no other key completes a handshake", metavar="PATH[,PATH...]"))
    peer_keys: str | None = field(default=None, metadata=flag(
        "decode (required there): public keys of the prefill engines allowed to send it KV, commits and transfer "
        "aborts (nothing else)", metavar="PATH[,PATH...]"))

    def load(self, role: str, listen: str) -> EngineLinkKeys:
        """Required on every address, loopback too (any local process can reach a loopback port)."""
        if not self.link_key or not self.frontend_keys:
            peers = " and --peer-keys PATH[,PATH...] (the prefill engines' public keys)" if role == "decode" else ""
            raise ConfigError(f"kvseal engine (listening on {listen}) needs keys: every engine link is "
                              f"authenticated with CurveZMQ, on loopback too. Give --link-key FILE (this engine's "
                              f"NAME.key_secret), --frontend-keys PATH[,PATH...] (the public keys of the frontends "
                              f"that may use it){peers}; {KEYS_HINT}")
        return EngineLinkKeys(load_key_pair(self.link_key), load_public_keys(self.frontend_keys, "--frontend-keys"),
                              load_public_keys(self.peer_keys, "--peer-keys") if self.peer_keys else ())


@dataclass(frozen=True)
class PdServeArgs:
    """`kvseal serve` in PD mode: against running engines, or one of each started here. (The
    engines' `--kv-transport` and `--reservation-timeout-s` are `NodeConfig`'s flags.)"""

    prefill: str | None = field(default=None, metadata=flag(
        "prefill engines to use (with --decode); the frontend loads no weights", metavar="HOST:PORT[,HOST:PORT...]"))
    decode: str | None = field(default=None, metadata=flag(
        "decode engines to use (with --prefill)", metavar="HOST:PORT[,HOST:PORT...]"))
    pd: bool = field(default=False, metadata=flag(
        "start one prefill and one decode engine on this host, and the frontend", action="store_true"))
    link_key: str | None = field(default=None, metadata=LINK_KEY)
    prefill_keys: str | None = field(default=None, metadata=flag(
        "with --prefill (required): each prefill engine's public key file, in the order of the addresses",
        metavar="FILE[,FILE...]"))
    decode_keys: str | None = field(default=None, metadata=flag(
        "with --decode (required): each decode engine's public key file, in the order of the addresses",
        metavar="FILE[,FILE...]"))
    pd_threads: str = field(default="auto", metadata=flag(
        "with --pd: CPU threads of the prefill and the decode engine; auto (the default) splits this process's "
        "cores between them, prefill taking the odd one, at least 1 each", metavar="PREFILL,DECODE"))


def node_config_from(ns: argparse.Namespace) -> NodeConfig:
    """`kvseal engine`'s node: its flags, its keys loaded first (an engine without them gets no further),
    and `--threads` (`EngineArgs.num_threads`)."""
    keys = EngineKeyFiles(**values_of(ns, EngineKeyFiles)).load(ns.role, ns.listen)
    return NodeConfig(**values_of(ns, NodeConfig), num_threads=ns.num_threads, link_keys=keys)
