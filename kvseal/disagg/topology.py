"""PD topology: which engines a PD frontend uses (`--prefill/--decode`) or starts (`--pd`), with
their keys (I9), read from the command line. Cheap to import (no torch): the command line reads
it to decide between the colocated and the PD backend."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field

from kvseal.config import MAX_NUM_THREADS
from kvseal.disagg.link_keys import (
    KEYS_HINT,
    EngineEndpoint,
    KeyPair,
    PublicKey,
    load_key_pair,
    load_public_key_list,
)
from kvseal.errors import ConfigError


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
        if not host or not (port.isascii() and port.isdigit()):
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
    if len(parts) != 2 or not all(p.strip().isascii() and p.strip().isdigit() and 1 <= int(p) <= MAX_NUM_THREADS
                                  for p in parts):
        raise ConfigError(f"--pd-threads takes auto or PREFILL,DECODE (two counts from 1 to {MAX_NUM_THREADS}), "
                          f"got {value!r}")
    return int(parts[0]), int(parts[1])


def num_usable_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
