"""`kvseal serve` in PD mode: the frontend over prefill and decode engines.

`--prefill A[,B] --decode C[,D]` uses running engines; `--pd` first starts one prefill and one
decode engine on loopback ports of this host (multiprocessing "spawn", so they exit with the
frontend) and stops them on the way out. The frontend loads no weights, only the tokenizer.

Keys (I9): with `--prefill/--decode` the frontend proves `--link-key` and expects each engine
to prove the public key given for it (`--prefill-keys`, `--decode-keys`, in address order).
`--pd` makes throw-away key pairs for itself and both engines at every start; an engine gets
its own pair and its allow-lists inside its `NodeConfig`, which multiprocessing hands over on
its private pipe (never in argv or the environment, which `ps` and /proc show).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import socket
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge

from kvseal.config import EngineArgs
from kvseal.disagg.engine_main import run_engine_process
from kvseal.disagg.frontend import EngineLink, PdClient
from kvseal.disagg.link_keys import (
    KEYS_HINT,
    EngineEndpoint,
    EngineLinkKeys,
    KeyPair,
    PublicKey,
    load_key_pair,
    load_public_key_list,
)
from kvseal.disagg.node import NodeConfig
from kvseal.errors import ConfigError
from kvseal.models.loader import convert_gguf, resolve_model_path

logger = logging.getLogger("kvseal.server")

STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SpawnKeys:
    """--pd: the throw-away key pairs of the engines it starts (the frontend's is the topology's)."""

    prefill: KeyPair
    decode: KeyPair


@dataclass(frozen=True)
class PdTopology:
    prefill: tuple[EngineEndpoint, ...]
    decode: tuple[EngineEndpoint, ...]
    spawn: bool  # --pd: start one of each here
    spawn_threads: tuple[int, int] = (1, 1)  # --pd: torch threads of the (prefill, decode) engine
    link_key: KeyPair = field(kw_only=True)  # what the frontend proves to every engine
    spawn_keys: SpawnKeys | None = field(default=None, kw_only=True)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> PdTopology | None:
        """None for colocated serving (no PD flag given)."""
        if ns.pd:
            return cls._spawned(ns)
        if ns.pd_threads != "auto":
            raise ConfigError("--pd-threads applies only to the engines --pd starts; give each engine you "
                              "start with `kvseal engine` its own --threads")
        if not ns.prefill and not ns.decode:
            if ns.link_key or ns.prefill_keys or ns.decode_keys:
                raise ConfigError("--link-key, --prefill-keys and --decode-keys apply to PD serving with "
                                  "--prefill/--decode only")
            return None
        if not ns.prefill or not ns.decode:
            raise ConfigError("PD serving needs both --prefill HOST:PORT[,...] and --decode HOST:PORT[,...]")
        prefill, decode = _addresses(ns.prefill, "--prefill"), _addresses(ns.decode, "--decode")
        if not ns.link_key or not ns.prefill_keys or not ns.decode_keys:
            raise ConfigError(f"PD serving with --prefill/--decode needs keys: every engine link is authenticated "
                              f"with CurveZMQ, on loopback too. Give --link-key FILE (this frontend's "
                              f"NAME.key_secret), --prefill-keys FILE[,...] and --decode-keys FILE[,...] (the "
                              f"engines' public keys, in the order of the addresses); {KEYS_HINT}")
        return cls(_endpoints(prefill, load_public_key_list(ns.prefill_keys, "--prefill-keys"), "--prefill"),
                   _endpoints(decode, load_public_key_list(ns.decode_keys, "--decode-keys"), "--decode"), False,
                   link_key=load_key_pair(ns.link_key))

    @classmethod
    def _spawned(cls, ns: argparse.Namespace) -> PdTopology:
        if ns.prefill or ns.decode:
            raise ConfigError("--pd starts its own engines; do not combine it with --prefill/--decode")
        if ns.link_key or ns.prefill_keys or ns.decode_keys:
            raise ConfigError("--pd makes its own throw-away keys; --link-key, --prefill-keys and --decode-keys "
                              "apply to --prefill/--decode only")
        threads = pd_threads(ns.pd_threads, num_usable_cores())
        keys = SpawnKeys(KeyPair.ephemeral("prefill"), KeyPair.ephemeral("decode"))
        return cls((EngineEndpoint(f"127.0.0.1:{_free_port()}", keys.prefill.public),),
                   (EngineEndpoint(f"127.0.0.1:{_free_port()}", keys.decode.public),), True, threads,
                   link_key=KeyPair.ephemeral("serve-pd"), spawn_keys=keys)


def _endpoints(addresses: tuple[str, ...], keys: tuple[PublicKey, ...], flag: str) -> tuple[EngineEndpoint, ...]:
    if len(keys) != len(addresses):
        raise ConfigError(f"{flag} names {len(addresses)} engines and {flag}-keys {len(keys)} public keys: give one "
                          f"key file per engine, in the order of the addresses")
    return tuple(EngineEndpoint(address, key.key) for address, key in zip(addresses, keys))


def _addresses(value: str, flag: str) -> tuple[str, ...]:
    addresses = tuple(a.strip() for a in value.split(",") if a.strip())
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"{flag} takes HOST:PORT[,HOST:PORT...]; {address!r} is not HOST:PORT")
    if len(set(addresses)) != len(addresses):
        raise ConfigError(f"{flag} lists an address twice: {value}")
    return addresses


def pd_threads(value: str, num_cores: int) -> tuple[int, int]:
    """`--pd-threads`: (prefill, decode) torch threads. "auto" splits `num_cores` so the two
    engines never run more threads than there are cores (prefill, the compute-bound role,
    takes the odd core); on a single core each still gets one."""
    if value == "auto":
        return max(1, num_cores - num_cores // 2), max(1, num_cores // 2)
    parts = value.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise ConfigError(f"--pd-threads takes auto or PREFILL,DECODE (two counts >= 1), got {value!r}")
    return int(parts[0]), int(parts[1])


def num_usable_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tokenizer_folder(model: str | None) -> str:
    """The folder whose tokenizer the frontend loads (a GGUF is converted once, as engines do)."""
    path = resolve_model_path(model)
    return str(convert_gguf(path) if path.suffix == ".gguf" else Path(path))


class PdMetrics:
    """Per-engine handoff metrics for /metrics, from each engine's `PdStatsMsg`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["role", "engine"]
        r = registry
        self.up = Gauge("kvseal_pd_engine_up", "1 while the engine answers", ["role", "address"], registry=r)
        self.transfers = Gauge("kvseal_pd_kv_transfers", "KV handoffs completed", labels, registry=r)
        self.bytes = Gauge("kvseal_pd_kv_transfer_bytes", "KV bytes moved by handoffs", labels, registry=r)
        self.seconds = Gauge("kvseal_pd_kv_transfer_seconds", "Prefill admission to commit, summed over "
                             "handoffs (divide by transfers for the mean)", labels, registry=r)
        self.failures = Gauge("kvseal_pd_handoff_failures", "Handoffs that failed or were refused, by reason",
                              [*labels, "reason"], registry=r)
        self.expired = Gauge("kvseal_pd_reservations_expired", "Decode reservations released for lack of a "
                             "commit", labels, registry=r)
        self.reservations = Gauge("kvseal_pd_reservations", "Decode pages held for transfers, in reservations",
                                  labels, registry=r)
        self.pages_used = Gauge("kvseal_pd_kv_pages_used", "KV pages owned", labels, registry=r)
        self.link_refusals = Gauge("kvseal_pd_link_refusals", "Engine link refusals (I9): CURVE handshakes from "
                                   "keys on no allow-list (kind=handshake), and messages the sender's role may not "
                                   "send (kind=message)", [*labels, "kind"], registry=r)

    def record(self, link: EngineLink) -> None:
        self.up.labels(role=link.role, address=link.address).set(1 if link.is_up else 0)
        stats = link.stats
        if stats is None:
            return
        labels = dict(role=stats.role, engine=stats.instance_id)
        self.transfers.labels(**labels).set(stats.num_transfers)
        self.bytes.labels(**labels).set(stats.num_transfer_bytes)
        self.seconds.labels(**labels).set(stats.transfer_s_total)
        self.expired.labels(**labels).set(stats.num_reservations_expired)
        self.reservations.labels(**labels).set(stats.num_reservations)
        self.pages_used.labels(**labels).set(stats.engine.num_pages_used)
        self.link_refusals.labels(**labels, kind="handshake").set(stats.num_refused_handshakes)
        self.link_refusals.labels(**labels, kind="message").set(stats.num_refused_messages)
        for reason, count in stats.handoff_failures.items():
            self.failures.labels(**labels, reason=reason).set(count)


class SpawnedEngines:
    """`--pd`: one prefill and one decode engine, children of the frontend process."""

    def __init__(self, topology: PdTopology, args: EngineArgs, ns: argparse.Namespace) -> None:
        ctx = multiprocessing.get_context("spawn")
        prefill_threads, decode_threads = topology.spawn_threads
        prefill_keys, decode_keys = spawned_link_keys(topology)
        configs = [NodeConfig("prefill", topology.prefill[0].address, ns.kv_transport, ns.reservation_timeout_s,
                              num_threads=prefill_threads, link_keys=prefill_keys),
                   NodeConfig("decode", topology.decode[0].address, ns.kv_transport, ns.reservation_timeout_s,
                              num_threads=decode_threads, link_keys=decode_keys)]
        log_level = getattr(ns, "log_level", "INFO")
        self.processes: list[BaseProcess] = [
            ctx.Process(target=run_engine_process, args=(args, config, log_level), name=f"kvseal-{config.role}",
                        daemon=False)
            for config in configs]
        for process in self.processes:
            process.start()
        logger.info("--pd: started prefill engine (pid %s) at %s with %d torch threads and decode engine (pid %s) "
                    "at %s with %d torch threads", self.processes[0].pid, topology.prefill[0].address,
                    prefill_threads, self.processes[1].pid, topology.decode[0].address, decode_threads)

    def stop(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                logger.error("engine %s did not stop within %g s; killing it", process.pid, STOP_TIMEOUT_S)
                process.kill()
                process.join()


def spawned_link_keys(topology: PdTopology) -> tuple[EngineLinkKeys, EngineLinkKeys]:
    """--pd: the prefill engine accepts the frontend; decode accepts the frontend and, as its one
    peer, the prefill engine."""
    assert topology.spawn_keys is not None, "--pd made the engines' keys"
    keys, frontend = topology.spawn_keys, topology.link_key.public_key()
    return (EngineLinkKeys(keys.prefill, (frontend,)),
            EngineLinkKeys(keys.decode, (frontend,), (keys.prefill.public_key(),)))


@dataclass
class PdBackend:
    client: PdClient
    spawned: SpawnedEngines | None

    async def shutdown(self) -> None:
        await self.client.shutdown()
        if self.spawned is not None:
            self.spawned.stop()


def start_pd_backend(topology: PdTopology, args: EngineArgs, ns: argparse.Namespace,
                     registry: CollectorRegistry) -> PdBackend:
    """Build the PD client (and, for --pd, its engines); `client.start()` waits for them."""
    metrics = PdMetrics(registry)
    spawned = SpawnedEngines(topology, args, ns) if topology.spawn else None
    for endpoint in (*topology.prefill, *topology.decode):  # public keys: what an operator checks against
        logger.info("PD engine at %s must prove the public key %s", endpoint.address, endpoint.public_key.decode())
    client = PdClient(list(topology.prefill), list(topology.decode), tokenizer_folder(args.model), topology.link_key,
                      metrics.record)
    return PdBackend(client, spawned)

