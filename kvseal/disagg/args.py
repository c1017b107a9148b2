"""Command-line flags of prefill/decode disaggregation (cheap to import: no torch, no zmq)."""

from __future__ import annotations

import argparse

DEFAULT_RESERVATION_TIMEOUT_S = 30.0
DEFAULT_DRAIN_S = 5.0  # nixl: see NodeConfig.transfer_drain_s
# tcp: KV frames on the ZMQ link (tcp.py); tcp-stream: KV on a plain TCP stream of its own,
# received straight into decode's pages (stream.py); nixl: NIXL one-sided WRITEs over UCX (nixl.py)
KV_TRANSPORTS = ("tcp", "tcp-stream", "nixl")
# The default since it measured ~1.4x the ZMQ path's throughput at half its CPU (docs/BENCHMARKS.md)
DEFAULT_KV_TRANSPORT = "tcp-stream"


def add_engine_node_arguments(parser: argparse.ArgumentParser) -> None:
    """`kvseal engine`: the role, the one address it binds, the KV transport."""
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--listen", required=True, metavar="HOST:PORT",
                        help="the only address this engine binds (frontends and peer engines connect here)")
    parser.add_argument("--kv-transport", choices=KV_TRANSPORTS, default=DEFAULT_KV_TRANSPORT,
                        help="how prompt KV moves from prefill to decode")
    parser.add_argument("--reservation-timeout-s", type=float, default=DEFAULT_RESERVATION_TIMEOUT_S,
                        help="decode: release a reservation that saw no commit after this long")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="CPU threads torch uses in this engine (default: torch's own, one per core); "
                             "engines that share a host should split its cores between them")
    parser.add_argument("--link-key", default=None, metavar="FILE",
                        help="required: this engine's CURVE key pair (NAME.key_secret, mode 0600), from "
                             "`kvseal keys generate`; every link to it is authenticated, loopback too")
    parser.add_argument("--frontend-keys", default=None, metavar="PATH[,PATH...]",
                        help="required: public keys (NAME.key files, or folders of them) of the frontends "
                             "allowed to use this engine; no other key completes a handshake")
    parser.add_argument("--peer-keys", default=None, metavar="PATH[,PATH...]",
                        help="decode (required there): public keys of the prefill engines allowed to send it "
                             "KV, commits and transfer aborts (nothing else)")


def add_pd_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """`kvseal serve` in PD mode: against running engines, or one of each started here."""
    parser.add_argument("--prefill", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                        help="prefill engines to use (with --decode); the frontend loads no weights")
    parser.add_argument("--decode", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                        help="decode engines to use (with --prefill)")
    parser.add_argument("--pd", action="store_true",
                        help="start one prefill and one decode engine on this host, and the frontend")
    parser.add_argument("--kv-transport", choices=KV_TRANSPORTS, default=DEFAULT_KV_TRANSPORT,
                        help="with --pd: how prompt KV moves from prefill to decode")
    parser.add_argument("--reservation-timeout-s", type=float, default=DEFAULT_RESERVATION_TIMEOUT_S,
                        help="with --pd: decode releases a reservation that saw no commit after this long")
    parser.add_argument("--link-key", default=None, metavar="FILE",
                        help="with --prefill/--decode (required): the frontend's CURVE key pair "
                             "(NAME.key_secret, mode 0600), whose public key the engines list in --frontend-keys; "
                             "--pd makes throw-away keys for itself and its engines")
    parser.add_argument("--prefill-keys", default=None, metavar="FILE[,FILE...]",
                        help="with --prefill (required): each prefill engine's public key file, in the order "
                             "of the addresses")
    parser.add_argument("--decode-keys", default=None, metavar="FILE[,FILE...]",
                        help="with --decode (required): each decode engine's public key file, in the order of "
                             "the addresses")
    parser.add_argument("--pd-threads", default="auto", metavar="PREFILL,DECODE",
                        help="with --pd: CPU threads of the prefill and the decode engine; auto (the default) "
                             "splits this process's cores between them, prefill taking the odd one, at least "
                             "1 each")
