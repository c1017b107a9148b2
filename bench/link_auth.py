"""Engine-link authentication cost (not a test): what I9 adds per request, measured in isolation.

1. Control messages: round trips of a PD request's control messages (a `ReserveMsg` of a
   --prompt-len prompt out, a `ReservedMsg` back; a `PrefillMsg` out, a `PrefillDoneMsg` back)
   over one DEALER->ROUTER pair on loopback, plain ZMQ against CURVE, alternating in rounds,
   between two processes (the engine's side echoes a reply of the real size).
2. The handshake: connect to handshake-succeeded, plain against CURVE with pyzmq's ZAP
   handler deciding (once per connection; links are long-lived).
3. tcp-stream's record tags: HMAC-SHA256 of one record's head, as the sender seals and decode
   verifies it, per record and per push (2 x layers + 1 records).

    python bench/link_auth.py --prompt-len 2048 --rounds 2000 --layers 30
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from kvseal.disagg.link_keys import KeyPair
from kvseal.disagg.msgs import (
    KVBlockMsg,
    PrefillDoneMsg,
    PrefillMsg,
    ReservedMsg,
    ReserveMsg,
    encode,
)
from kvseal.disagg.stream import record_tag, sealed_record
from kvseal.messages.convert import params_to_msg
from kvseal.types import SamplingParams


def control_messages(prompt_len: int) -> list[tuple[bytes, bytes]]:
    """(request, reply) pairs of one PD request's control traffic, encoded."""
    prompt, params = list(range(1000, 1000 + prompt_len)), params_to_msg(SamplingParams(max_tokens=16))
    pages, key = list(range(prompt_len // 16 + 1)), os.urandom(32)
    reserve = ReserveMsg("req-1", "alice", prompt, params)
    reserved = ReservedMsg("req-1", "alice", "t" * 32, pages, 16, "127.0.0.1:5555", key, 0)
    prefill = PrefillMsg("req-1", "alice", prompt, params, "t" * 32, "127.0.0.1:5556", b"k" * 40, "decode-1",
                         "127.0.0.1:5555", key, pages, 0)
    done = PrefillDoneMsg("req-1", "t" * 32, "prefill-1", prompt_len, 1 << 20, 0.1)
    return [(encode(reserve), encode(reserved)), (encode(prefill), encode(done))]


class Allow:
    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


def echo_server(conn: Any, curve: bool, server: KeyPair, client_public: bytes) -> None:
    """The engine's side: a ROUTER (a CURVE server with a ZAP allow-list, or plain) answering
    each request with the reply of the same index."""
    ctx = zmq.Context()
    auth = None
    router = ctx.socket(zmq.ROUTER)
    if curve:
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback("bench", Allow(client_public))
        router.curve_server, router.curve_secretkey, router.curve_publickey = True, server.secret, server.public
        router.zap_domain = b"bench"
        router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    replies = conn.recv()
    conn.send(port)
    while True:
        frames = router.recv_multipart()
        if frames[1] == b"stop":
            break
        router.send_multipart([frames[0], replies[frames[1][0]]])
    router.close(0)
    if auth is not None:
        auth.stop()
    ctx.term()


def connect(ctx: zmq.Context, port: int, curve: bool, client: KeyPair,
            server_public: bytes) -> tuple[zmq.Socket, float]:
    """A DEALER to the echo server; the seconds from connect to a completed handshake."""
    dealer = ctx.socket(zmq.DEALER)
    if curve:
        dealer.curve_secretkey, dealer.curve_publickey, dealer.curve_serverkey = client.secret, client.public, \
            server_public
    monitor = dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    start = time.perf_counter()
    dealer.connect(f"tcp://127.0.0.1:{port}")
    recv_monitor_message(monitor)
    handshake_s = time.perf_counter() - start
    dealer.disable_monitor()
    monitor.close(0)
    return dealer, handshake_s


def round_trips(dealer: zmq.Socket, messages: list[tuple[bytes, bytes]], rounds: int) -> list[float]:
    """Seconds per request's control traffic (every message out and its reply back), per round."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for index, (request, _) in enumerate(messages):
            dealer.send(bytes([index]) + request)
            dealer.recv()
        times.append(time.perf_counter() - start)
    return times


def measure_control(prompt_len: int, rounds: int, num_blocks: int) -> dict[str, Any]:
    messages = control_messages(prompt_len)
    server, client = KeyPair.ephemeral("engine"), KeyPair.ephemeral("frontend")
    ctx, spawn = zmq.Context(), multiprocessing.get_context("spawn")
    results: dict[str, dict[str, list[float]]] = {"plain": {"rtt": [], "handshake": []},
                                                  "curve": {"rtt": [], "handshake": []}}
    for _ in range(num_blocks):  # alternate, so load on the host hits both alike
        for kind in ("plain", "curve"):
            conn, child = spawn.Pipe()
            process = spawn.Process(target=echo_server, args=(child, kind == "curve", server, client.public))
            process.start()
            conn.send([reply for _, reply in messages])
            dealer, handshake_s = connect(ctx, conn.recv(), kind == "curve", client, server.public)
            round_trips(dealer, messages, max(1, rounds // 10))  # warm-up
            results[kind]["rtt"] += round_trips(dealer, messages, rounds)
            results[kind]["handshake"].append(handshake_s)
            dealer.send(b"stop")
            process.join(30)
            dealer.close(0)
    ctx.term()
    plain, curve = (statistics.median(results[k]["rtt"]) for k in ("plain", "curve"))
    return {"control_bytes_out": sum(len(r) for r, _ in messages),
            "control_bytes_back": sum(len(b) for _, b in messages),
            "control_plain_median_s": plain, "control_curve_median_s": curve, "control_curve_added_s": curve - plain,
            "handshake_plain_median_s": statistics.median(results["plain"]["handshake"]),
            "handshake_curve_zap_median_s": statistics.median(results["curve"]["handshake"])}


def measure_tags(num_layers: int, rounds: int) -> dict[str, Any]:
    key, header = os.urandom(32), KVBlockMsg("t" * 32, 17, "k", 0, 2048)
    head = sealed_record(header, 1 << 20, key, 0)[:-16]
    start = time.perf_counter()
    for number in range(rounds):
        record_tag(key, number, head)
    per_tag_s = (time.perf_counter() - start) / rounds
    return {"tag_per_record_s": per_tag_s, "records_per_push": 2 * num_layers + 1,
            "tags_per_push_s_each_side": per_tag_s * (2 * num_layers + 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2000, help="control round trips per block and kind")
    parser.add_argument("--blocks", type=int, default=3, help="alternating blocks of plain and CURVE")
    parser.add_argument("--layers", type=int, default=30, help="model layers (records per tcp-stream push)")
    ns = parser.parse_args()
    result = {"load_average_before": os.getloadavg(), "prompt_len": ns.prompt_len}
    result.update(measure_control(ns.prompt_len, ns.rounds, ns.blocks))
    result.update(measure_tags(ns.layers, 100_000))
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
