"""PD benchmark (not a test): TTFT colocated vs PD, and KV transfer throughput vs raw loopback.

On the default model (SmolLM2-135M-Instruct GGUF) unless --model is given:

1. TTFT for --prompt-len-token prompts, in this process: a colocated `LLMEngine` (add the
   request, step until the first token) against a prefill and a decode engine (reserve, prefill,
   push KV, commit, verify, first token at the frontend), alternating, --repeats times each.
2. KV transfer throughput, per transport, with prefill's sender in this process and decode's
   receiver in a second one (as in real PD): the prompt's KV (every layer, K and V) pushed from
   prefill's pool into a decode reservation, from the start of `push` until the receiver has
   it in its pool and recorded (stage, move, land, copy in, record). Against that library's own
   raw loopback copy of the same bytes between the same two processes in the same run: for
   tcp, the same number of frames of the same sizes over a bare ZMQ DEALER->ROUTER pair (no
   staging, no import); for tcp-stream (KV on a plain TCP stream, received straight into the
   pages), one `sendall` of the same number of bytes into one `recv_into` buffer over a bare
   loopback socket pair (its target), and the raw ZMQ copy too (both ratios are reported, for
   tcp as well); for nixl, one NIXL WRITE of the same number of bytes between two registered
   buffers, done when the receiver has the notification (no staging, no import); and against
   one in-process memcpy of those bytes.

Every engine link is CURVE-authenticated (I9), as in production: the TTFT pair's engines prove
their keys and accept only the bench's frontend key (and decode prefill's); the tcp transport's
frames ride a CURVE link (encrypted), and the raw ZMQ loopback is reported both plain and over
CURVE, so CURVE's own cost on the KV frames is visible; tcp-stream's records carry HMAC tags.

    python bench/pd.py                  # 2,048-token prompts, 3 repeats, tcp and nixl
    python bench/pd.py --repeats 5 --prompt-len 1024 --transports nixl
    python bench/pd.py --skip-ttft      # transfer throughput only
    python bench/pd.py --skip-ttft --repeats 9 --transports tcp,tcp-stream  # both TCP data paths
    python bench/pd.py --skip-ttft --page-order shuffled  # scattered pages on both sides
    python bench/pd.py --skip-ttft --page-order shuffled-prefill  # scattered on prefill's side only
    python bench/pd.py --tp 2 --repeats 5   # only the tensor-parallel part of a handoff, TP=2

3. With --tp N (N > 1), instead of 1 and 2: what tensor parallelism adds to a handoff. The wire
   carries full pages at any N (the transfer is the one measured at TP=1), so a TP=N handoff is
   the TP=1 handoff plus prefill's gather (every rank's KV heads of the prompt's pages to rank 0's
   staging pool, `parallel/handoff.py` `RankHandoff.gather`) and decode's scatter (rank 0 hands
   each rank its heads and every rank reports them recorded, `RankHandoff.scatter`). Both are
   timed on one TP=N engine in this process (torch.distributed allows one group a process): the
   gather of a prompt it prefilled, the scatter into a fresh reservation of the same length.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import platform
import random
import select
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import zmq

from kvseal.config import EngineArgs
from kvseal.disagg.config import NodeConfig
from kvseal.disagg.link_auth import secure_client
from kvseal.disagg.link_keys import EngineLinkKeys, KeyPair
from kvseal.disagg.msgs import KVBlockMsg, PdMsg, PrefillMsg, ReservedMsg, ReserveMsg, decode, encode
from kvseal.disagg.nixl import POLL_SLEEP_S, NixlReceiver, NixlSender, make_agent
from kvseal.disagg.node import EngineNode
from kvseal.disagg.stream import StreamReceiver, StreamSender, split_address
from kvseal.disagg.tcp import TcpReceiver, TcpSender
from kvseal.disagg.transport import KINDS, KVReceiver, KVSender, PushPlan
from kvseal.disagg.wire import PeerLinks
from kvseal.engine.engine import LLMEngine
from kvseal.kvcache.pool import KVPool
from kvseal.messages.convert import params_to_msg
from kvseal.messages.msgs import OutputsMsg
from kvseal.models.loader import load_model
from kvseal.parallel.handoff import RankHandoff
from kvseal.types import SamplingParams

MiB = 1024 * 1024
PUMP_DEADLINE_S = 1800.0
PARAMS = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class Pair:
    """A prefill and a decode engine in this process, and a frontend's two DEALERs."""

    def __init__(self, args: EngineArgs, loaded: Any, kv_transport: str = "tcp") -> None:
        self.ctx = zmq.Context()  # the frontend's; each engine has its own (and its own ZAP handler)
        self.kv_transport = kv_transport
        self.frontend_key = frontend = KeyPair.ephemeral("bench-frontend")
        prefill_key, decode_key = KeyPair.ephemeral("bench-prefill"), KeyPair.ephemeral("bench-decode")
        args = dataclasses.replace(args, pd_role=True)  # a TP engine's staging pool inside the KV budget
        self.prefill = EngineNode(LLMEngine(args, loaded), NodeConfig(
            "prefill", free_address(), kv_transport, link_keys=EngineLinkKeys(prefill_key, (frontend.public_key(),))))
        # A 2,048-token prefill takes a minute on a loaded 2-core host: longer than the default timeout.
        self.decode = EngineNode(LLMEngine(args, loaded), NodeConfig(
            "decode", free_address(), kv_transport, reservation_timeout_s=PUMP_DEADLINE_S,
            link_keys=EngineLinkKeys(decode_key, (frontend.public_key(),), (prefill_key.public_key(),))))
        self.to_prefill, self.to_decode = self._dealer(self.prefill), self._dealer(self.decode)
        self._ids = iter(range(10**9))

    def _dealer(self, node: EngineNode) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        secure_client(sock, self.frontend_key, node.config.link_keys.own.public)
        sock.connect(f"tcp://{node.config.listen}")
        return sock

    def close(self) -> None:
        """Close every socket and context now (a context left to the garbage collector may
        block a later send in its `term`)."""
        for sock in (self.to_prefill, self.to_decode):
            sock.close(0)
        for node in (self.prefill, self.decode):
            node.close()
            node.ctx.term()
        self.ctx.term()

    def pump_until(self, sock: zmq.Socket, accept: Callable[[PdMsg], bool]) -> PdMsg:
        deadline = time.monotonic() + PUMP_DEADLINE_S
        while time.monotonic() < deadline:
            self.prefill.loop.run_once(idle_poll_ms=0)
            self.decode.loop.run_once(idle_poll_ms=0)
            while sock.poll(0):
                msg = decode(sock.recv())
                if accept(msg):
                    return msg
        raise TimeoutError(f"no answer within {PUMP_DEADLINE_S} s")

    def reserve(self, prompt: list[int]) -> ReservedMsg:
        request_id = f"bench-{next(self._ids)}"
        # A tenant (so a prefix-cache namespace) of its own per request: no prefix-cache hit, every
        # handoff moves the whole prompt.
        self.to_decode.send(encode(ReserveMsg(request_id, request_id, prompt, params_to_msg(PARAMS))))
        reserved = self.pump_until(self.to_decode, lambda m: isinstance(m, ReservedMsg))
        assert isinstance(reserved, ReservedMsg)
        return reserved

    def first_token(self, prompt: list[int]) -> None:
        r = self.reserve(prompt)
        self.to_prefill.send(encode(PrefillMsg(r.request_id, r.request_id, prompt, params_to_msg(PARAMS), r.transfer_id,
                                               self.decode.config.listen, self.decode.config.link_keys.own.public,
                                               self.decode.instance_id, r.kv_address, r.transfer_key, r.pages,
                                               r.num_cached_tokens)))
        self.pump_until(self.to_decode, lambda m: isinstance(m, OutputsMsg) and any(
            o.request_id == r.request_id and o.new_token_ids for o in m.outputs))


def ttft_colocated(engine: LLMEngine, prompt: list[int], n: int) -> float:
    start = time.perf_counter()
    # A tenant (so a namespace) of its own per request, as PD's `reserve`: no prefix-cache hit (the
    # cache is on by default), so both sides compute the whole prompt.
    engine.add_request(f"colocated-{n}", prompt, PARAMS, tenant=f"colocated-{n}")
    while not any(o.new_token_ids for o in engine.step()):
        pass
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def ttft_pd(pair: Pair, prompt: list[int]) -> float:
    start = time.perf_counter()
    pair.first_token(prompt)
    return time.perf_counter() - start


# ---- decode's side: a second process ------------------------------------------------------

PoolShape = tuple[int, int, int, int, int, str]  # layers, pages, page_size, kv_heads, head_dim, dtype


def decode_process(conn: Any, transport: str, shape: PoolShape) -> None:
    """Decode's receiver over its own pool, in its own process; serves commands from `conn`:
    ("authorize", transfer id, pages, num positions, key) -> the transfer's KV address, then the time every
    layer's K and V landed; ("raw_zmq", sizes, curve) and ("raw_nixl", num bytes): the raw loopback receivers.
    Its first answer is (its KV address, its CURVE public key): its ROUTER is a CURVE server, as decode's is."""
    torch.set_num_threads(1)
    num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype = shape
    torch_dtype = getattr(torch, dtype.removeprefix("torch."))
    pool = KVPool(num_layers, num_pages, page_size, num_kv_heads, head_dim, torch_dtype)
    ctx = zmq.Context()
    own = KeyPair.ephemeral("bench-decode")
    router = curve_router(ctx, own)
    router.bind("tcp://127.0.0.1:0")
    address = endpoint(router).removeprefix("tcp://")
    receiver: KVReceiver
    if transport == "tcp":
        receiver = TcpReceiver(pool, len(pool.k), address)
    elif transport == "tcp-stream":
        receiver = StreamReceiver(pool, len(pool.k), "127.0.0.1")
    else:
        receiver = NixlReceiver(pool, f"bench-decode-{os.getpid()}", "127.0.0.1")
    raw_buffers: dict[int, bytearray] = {}  # the raw socket receiver's buffer, warm after the warm-up
    conn.send((receiver.address, own.public))
    while True:
        command = conn.recv()
        if command[0] == "stop":
            break
        if command[0] == "authorize":
            conn.send(receive_transfer(conn, router, receiver, pool, *command[1:]))
        elif command[0] == "raw_zmq":
            conn.send(raw_zmq_receive(conn, ctx, command[1], own if command[2] else None))
        elif command[0] == "raw_nixl":
            conn.send(raw_nixl_receive(conn, command[1]))
        elif command[0] == "raw_socket":
            buffer = raw_buffers.setdefault(command[1], bytearray(command[1]))
            conn.send(raw_socket_receive(conn, buffer))
    receiver.close()
    router.close(0)
    ctx.term()


def curve_router(ctx: zmq.Context, own: KeyPair) -> zmq.Socket:
    """A ROUTER that is a CURVE server proving `own` (no ZAP handler here: any client key may
    finish the handshake; the per-message cost is what is measured)."""
    router = ctx.socket(zmq.ROUTER)
    router.curve_server, router.curve_secretkey, router.curve_publickey = True, own.secret, own.public
    return router


def endpoint(sock: zmq.Socket) -> str:
    raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(raw, bytes)
    return raw.decode()


def receive_transfer(conn: Any, router: zmq.Socket, receiver: KVReceiver, pool: KVPool, transfer_id: str,
                     pages: list[int], num_positions: int, key: bytes) -> tuple[float, float]:
    """What decode's engine loop does for a transfer, until every layer's K and V landed:
    (when, CPU seconds this process spent from the authorization on)."""
    receiver.authorize(transfer_id, pages, key=key)
    conn.send(receiver.address_for(transfer_id))
    start_cpu_s, num_layers = time.process_time(), len(pool.k)
    expected_bytes = num_layers * 2 * len(pages) * pool.k[0][:, 0].numel() * pool.k[0].element_size()

    def complete() -> bool:  # the coverage check runs once all bytes are in (decode runs it once, at the commit)
        landing = receiver.landed(transfer_id)
        assert landing is not None
        return landing.num_bytes >= expected_bytes and all(
            landing.covered_prefix(layer, kind) >= num_positions for layer in range(num_layers) for kind in KINDS)

    while not complete():
        if isinstance(receiver, StreamReceiver):  # decode's loop: wait on its sockets, take in what is there
            select.select(receiver.fds(), [], [], 0.001)
            receiver.progress()
        elif router.poll(1 if isinstance(receiver, TcpReceiver) else 0):
            while True:
                try:
                    frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                msg = decode(frames[1].bytes)
                assert isinstance(msg, KVBlockMsg)
                assert receiver.deliver(msg, [frame.buffer for frame in frames[2:]]) is None
        elif not isinstance(receiver, TcpReceiver):
            time.sleep(POLL_SLEEP_S)
    done_s, cpu_s = time.perf_counter(), time.process_time() - start_cpu_s
    while not receiver.cancel(transfer_id):
        time.sleep(POLL_SLEEP_S)
    return done_s, cpu_s


def raw_zmq_receive(conn: Any, ctx: zmq.Context, sizes: list[int], curve: KeyPair | None) -> tuple[float, float]:
    """Frames over a bare ROUTER: plain ZMQ, or a CURVE server proving `curve`."""
    router = ctx.socket(zmq.ROUTER) if curve is None else curve_router(ctx, curve)
    router.bind("tcp://127.0.0.1:0")
    conn.send(endpoint(router))
    router.recv_multipart()  # the sender's hello: connected
    _recv_frames(router, sum(sizes))  # the untimed warm-up round, as for the raw socket
    conn.send("ready")
    start_cpu_s = time.process_time()
    _recv_frames(router, sum(sizes))
    done_s, cpu_s = time.perf_counter(), time.process_time() - start_cpu_s
    router.close(0)
    return done_s, cpu_s


def _recv_frames(router: zmq.Socket, total: int) -> None:
    received = 0
    while received < total:
        if router.poll(1):
            received += len(router.recv_multipart(copy=False)[2].buffer)


def raw_socket_receive(conn: Any, buffer: bytearray) -> tuple[float, float]:
    """One loopback TCP connection: everything into one warm buffer by `recv_into`, twice. The
    first round warms the connection (TCP's window and buffer autotuning start small on a new
    connection, and the transports' connections are long-lived); only the second is timed."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn.send(f"127.0.0.1:{listener.getsockname()[1]}")
        sock, _ = listener.accept()
    view = memoryview(buffer)
    with sock:
        _recv_exactly(sock, view)
        conn.send("ready")
        start_cpu_s = time.process_time()
        _recv_exactly(sock, view)
        return time.perf_counter(), time.process_time() - start_cpu_s


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    received = 0
    while received < len(view):
        num = sock.recv_into(view[received:])
        assert num, "the raw sender closed early"
        received += num


def raw_nixl_receive(conn: Any, num_bytes: int) -> tuple[float, float]:
    agent = make_agent(f"bench-raw-receiver-{random.getrandbits(32)}", "127.0.0.1")
    dst = torch.zeros(num_bytes, dtype=torch.uint8)
    registration = agent.register_memory(dst)
    conn.send((agent.get_agent_metadata(), dst.data_ptr()))
    note = conn.recv()
    start_cpu_s = time.process_time()
    while not any(note in msgs for msgs in agent.get_new_notifs().values()):
        time.sleep(POLL_SLEEP_S)
    done_s, cpu_s = time.perf_counter(), time.process_time() - start_cpu_s
    agent.deregister_memory(registration)
    return done_s, cpu_s


# ---- prefill's side: this process ----------------------------------------------------------


class TransferBench:
    """Prefill's pool and sender here, decode's receiver in a child process."""

    def __init__(self, transport: str, pool: KVPool, num_positions: int, page_order: str) -> None:
        self.transport, self.pool, self.num_positions = transport, pool, num_positions
        num_kv_heads, page_size, head_dim = pool.page_shape()
        shape: PoolShape = (len(pool.k), pool.num_pages, page_size, num_kv_heads, head_dim, str(pool.k[0].dtype))
        self.conn, child = multiprocessing.get_context("spawn").Pipe()
        self.process = multiprocessing.get_context("spawn").Process(target=decode_process,
                                                                    args=(child, transport, shape))
        self.process.start()
        self.kv_address, self.decode_key = self.conn.recv()
        self.ctx = zmq.Context()
        self.own = KeyPair.ephemeral("bench-prefill")
        self.links = PeerLinks(self.ctx, self.own)
        self.sender: KVSender
        if transport == "tcp":
            self.sender = TcpSender(self.links)
        elif transport == "tcp-stream":
            self.sender = StreamSender()
        else:
            self.sender = NixlSender(f"bench-prefill-{os.getpid()}", "127.0.0.1")
        num_pages = -(-num_positions // page_size)
        self.src_pages, self.dest_pages = list(range(num_pages)), list(range(num_pages))
        if page_order in ("shuffled", "shuffled-prefill"):
            random.Random(1).shuffle(self.src_pages)
        if page_order == "shuffled":  # decode's reservations are one run wherever its pool has one
            random.Random(2).shuffle(self.dest_pages)
        self._ids = iter(range(10**9))

    def transfer(self) -> tuple[float, float, int, tuple[float, float]]:
        """One push: (MiB/s until decode has it all, MiB/s until `push` returned, bytes, CPU
        seconds (prefill's process, decode's process))."""
        transfer_id, key = f"bench-{next(self._ids)}", os.urandom(32)
        self.conn.send(("authorize", transfer_id, self.dest_pages, self.num_positions, key))
        kv_address = self.conn.recv()  # the transfer's own address (NIXL's names its arena pages)
        plan = PushPlan(transfer_id, self.src_pages, [self.num_positions] * len(self.pool.k), kv_address,
                        self.dest_pages, transfer_key=key, decode_key=self.decode_key)
        start, start_cpu_s = time.perf_counter(), time.process_time()
        num_bytes = self.sender.push(plan, self.pool)
        pushed_s = time.perf_counter() - start
        done_s, receiver_cpu_s = self.conn.recv()
        cpu = (time.process_time() - start_cpu_s, receiver_cpu_s)
        return num_bytes / (done_s - start) / MiB, num_bytes / pushed_s / MiB, num_bytes, cpu

    def raw(self, frame_sizes: list[int]) -> tuple[float, tuple[float, float]]:
        """MiB/s of the transport's own raw loopback copy (its target), and CPU seconds (this
        process, the receiver's)."""
        if self.transport == "tcp":
            return self.raw_zmq(frame_sizes)
        if self.transport == "tcp-stream":
            return self.raw_socket(sum(frame_sizes))
        return self.raw_nixl(sum(frame_sizes))

    def other_raw(self, frame_sizes: list[int]) -> list[tuple[str, float]]:
        """The TCP transports' other raw loopbacks (tcp: the bare socket; tcp-stream: bare ZMQ;
        both: ZMQ over CURVE, the tcp transport's link), reported beside the target's ratio so
        the two data paths compare on each."""
        if self.transport == "tcp":
            return [("socket", self.raw_socket(sum(frame_sizes))[0]), ("zmq_curve", self.raw_zmq(frame_sizes, True)[0])]
        if self.transport == "tcp-stream":
            return [("zmq", self.raw_zmq(frame_sizes)[0]), ("zmq_curve", self.raw_zmq(frame_sizes, True)[0])]
        return []

    def raw_socket(self, num_bytes: int) -> tuple[float, tuple[float, float]]:
        """One `sendall` of `num_bytes` over a bare loopback TCP connection into the child's one
        warm `recv_into` buffer, timed on the connection's second round (see `raw_socket_receive`)."""
        self.conn.send(("raw_socket", num_bytes))
        sock = socket.create_connection(split_address(self.conn.recv()))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = torch.empty(num_bytes, dtype=torch.uint8).random_().numpy().data
        sock.sendall(data)  # the untimed warm-up round
        assert self.conn.recv() == "ready"
        start, start_cpu_s = time.perf_counter(), time.process_time()
        sock.sendall(data)
        done_s, receiver_cpu_s = self.conn.recv()
        cpu = (time.process_time() - start_cpu_s, receiver_cpu_s)
        sock.close()
        return num_bytes / (done_s - start) / MiB, cpu

    def raw_zmq(self, sizes: list[int], curve: bool = False) -> tuple[float, tuple[float, float]]:
        """Frames of the same sizes over a bare DEALER->ROUTER pair (plain, or over CURVE),
        received in full by the child; timed on the connection's second round (see
        `raw_socket_receive`)."""
        self.conn.send(("raw_zmq", sizes, curve))
        dealer = self.ctx.socket(zmq.DEALER)
        if curve:
            secure_client(dealer, self.own, self.decode_key)
        dealer.connect(self.conn.recv())
        dealer.send(b"hello")
        frames = [torch.empty(n, dtype=torch.uint8).random_().numpy().data for n in sizes]
        for frame in frames:  # the untimed warm-up round
            dealer.send_multipart([b"h", frame], copy=False)
        assert self.conn.recv() == "ready"
        start, start_cpu_s = time.perf_counter(), time.process_time()
        for frame in frames:
            dealer.send_multipart([b"h", frame], copy=False)
        done_s, receiver_cpu_s = self.conn.recv()
        cpu = (time.process_time() - start_cpu_s, receiver_cpu_s)
        dealer.close(0)
        return sum(sizes) / (done_s - start) / MiB, cpu

    def raw_nixl(self, num_bytes: int) -> tuple[float, tuple[float, float]]:
        """One NIXL WRITE of `num_bytes` into the child's registered buffer (one descriptor, as
        a reservation of consecutive pages is), done when the child has the notification."""
        self.conn.send(("raw_nixl", num_bytes))
        metadata, dst_address = self.conn.recv()
        agent = self.raw_agent()
        src = torch.empty(num_bytes, dtype=torch.uint8).random_()
        registration = agent.register_memory(src)
        remote = agent.add_remote_agent(metadata)
        note = f"raw-{random.getrandbits(32)}".encode()
        rows = np.array([[src.data_ptr(), num_bytes, 0]], dtype=np.uint64)
        remote_rows = np.array([[dst_address, num_bytes, 0]], dtype=np.uint64)
        handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(rows, "DRAM"),
                                       agent.get_xfer_descs(remote_rows, "DRAM"), remote, note)
        self.conn.send(note)
        start, start_cpu_s = time.perf_counter(), time.process_time()
        state = agent.transfer(handle)
        while state == "PROC":
            time.sleep(POLL_SLEEP_S)
            state = agent.check_xfer_state(handle)
        assert state == "DONE", state
        done_s, receiver_cpu_s = self.conn.recv()
        cpu = (time.process_time() - start_cpu_s, receiver_cpu_s)
        agent.release_xfer_handle(handle)
        agent.remove_remote_agent(remote)
        agent.deregister_memory(registration)
        return num_bytes / (done_s - start) / MiB, cpu

    def raw_agent(self) -> Any:
        if not hasattr(self, "_raw_agent"):
            self._raw_agent = make_agent(f"bench-raw-sender-{os.getpid()}", "127.0.0.1")
        return self._raw_agent

    def frame_sizes(self) -> list[int]:
        """What the TCP transport sends for this prompt: K and V of every layer, whole pages."""
        num_kv_heads, page_size, head_dim = self.pool.page_shape()
        size = num_kv_heads * len(self.src_pages) * page_size * head_dim * self.pool.k[0].element_size()
        return [size] * (2 * len(self.pool.k))

    def close(self) -> None:
        self.conn.send(("stop",))
        self.process.join(30)
        self.sender.close()
        self.links.close()
        self.ctx.term()


def memcpy_rate(num_bytes: int) -> float:
    src, dst = torch.empty(num_bytes, dtype=torch.uint8).random_(), torch.empty(num_bytes, dtype=torch.uint8)
    dst.copy_(src)
    start = time.perf_counter()
    dst.copy_(src)
    return num_bytes / (time.perf_counter() - start) / MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transports", default="tcp,nixl", help="comma-separated KV transports to measure")
    parser.add_argument("--skip-ttft", action="store_true", help="measure only the KV transfer throughput")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--tp", type=int, default=1, help="N > 1: time only a TP=N handoff's gather and scatter")
    parser.add_argument("--page-order", choices=("consecutive", "shuffled", "shuffled-prefill"), default="consecutive",
                        help="prefill's and decode's pages for the transfer: consecutive (a fresh pool), shuffled, "
                             "or shuffled on prefill's side only (decode's reservations take a run of pages)")
    ns = parser.parse_args()
    if ns.threads is not None:
        torch.set_num_threads(ns.threads)
    args = EngineArgs(model=ns.model, dtype=ns.dtype, max_model_len=ns.prompt_len + 16,
                      kv_cache_tokens=4 * (ns.prompt_len + 16))
    if ns.tp > 1:
        print(json.dumps(measure_tp_handoff(dataclasses.replace(args, tensor_parallel_size=ns.tp), ns.prompt_len,
                                            ns.repeats), indent=2))
        return
    loaded = load_model(args.model, args.torch_dtype)
    transports = ns.transports.split(",")
    result: dict[str, Any] = {
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "model": str(loaded.path), "dtype": args.dtype, "prompt_len": ns.prompt_len, "repeats": ns.repeats,
        "page_order": ns.page_order, "load_average_before": os.getloadavg(),
    }
    if not ns.skip_ttft:
        if transports[0] == "tcp-stream":  # in one process its blocking send would wait on its own receiver
            parser.error("TTFT runs prefill and decode in one process: put tcp or nixl first, or --skip-ttft")
        result.update(measure_ttft(args, loaded, transports[0], ns.prompt_len, ns.repeats))
    result.update(measure_transfers(args, loaded, transports, ns.prompt_len, ns.repeats, ns.page_order))
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result, indent=2))


def measure_tp_handoff(args: EngineArgs, prompt_len: int, repeats: int) -> dict[str, Any]:
    """Seconds of RankHandoff.gather and .scatter of a prefilled prompt's pages, per repeat."""
    engine = LLMEngine(args)
    try:
        prompt = [int(t) for t in torch.randint(100, engine.model_config.vocab_size - 100, (prompt_len,),
                                                generator=torch.Generator().manual_seed(0))]
        engine.add_request("tp-handoff", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        while not engine.step():  # until the prompt is prefilled (its first token)
            pass
        assert engine.driver is not None
        handoff = RankHandoff(engine.driver, engine.model_config, engine.kv)
        pages = engine.kv.block_table("tp-handoff", prompt_len).tolist()
        gather_s, scatter_s = [], []
        for n in range(repeats + 1):  # the first: warm-up
            start = time.perf_counter()
            handoff.gather("tp-handoff", pages)
            gather_s.append(time.perf_counter() - start)
            handoff.clear(pages)
            receiver = f"tp-import-{n}"  # as decode: a fresh reservation of the prompt's length
            engine.kv.reserve(receiver, "bench", prompt_len)
            reserved = engine.kv.block_table(receiver, prompt_len).tolist()
            start = time.perf_counter()
            refused = handoff.scatter(receiver, reserved, 0, prompt_len)
            scatter_s.append(time.perf_counter() - start)
            assert refused is None, refused
            handoff.clear(reserved)
            engine.kv.free(receiver)
    finally:
        engine.close()
    kv_bytes = handoff.wire.num_bytes * prompt_len // engine.cache_config.kv_cache_tokens  # every KV head
    return {"tp": args.tensor_parallel_size, "prompt_len": prompt_len, "dtype": args.dtype,
            "kv_bytes_of_prompt": kv_bytes, "gather_s": gather_s[1:], "scatter_s": scatter_s[1:],
            "gather_median_s": statistics.median(gather_s[1:]), "scatter_median_s": statistics.median(scatter_s[1:]),
            "load_average": os.getloadavg()}


def measure_ttft(args: EngineArgs, loaded: Any, transport: str, prompt_len: int, repeats: int) -> dict[str, Any]:
    prompt = [int(t) for t in torch.randint(100, loaded.config.vocab_size - 100, (prompt_len,),
                                            generator=torch.Generator().manual_seed(0))]
    colocated, pair = LLMEngine(args, loaded), Pair(args, loaded, transport)
    try:
        ttft_colocated(colocated, prompt, -1)  # warm-up: first-use kernel setup on both paths
        ttft_pd(pair, prompt)
        colocated_s, pd_s = [], []
        for n in range(repeats):
            colocated_s.append(ttft_colocated(colocated, prompt, n))
            pd_s.append(ttft_pd(pair, prompt))
    finally:
        pair.close()
    return {"ttft_transport": transport, "ttft_colocated_s": colocated_s, "ttft_pd_s": pd_s,
            "ttft_pd_over_colocated": statistics.median(pd_s) / statistics.median(colocated_s)}


def measure_transfers(args: EngineArgs, loaded: Any, transports: list[str], prompt_len: int, repeats: int,
                      page_order: str) -> dict[str, Any]:
    """Each repeat: per transport, one push and its raw loopback, back to back; one memcpy."""
    pool = LLMEngine(args, loaded).kv.pool  # prefill's pool, holding random KV
    for k, v in zip(pool.k, pool.v):
        k.normal_()
        v.normal_()
    benches = {t: TransferBench(t, pool, prompt_len, page_order) for t in transports}
    try:
        for bench in benches.values():  # warm-up: connections, registrations, first-touch buffers
            bench.transfer()
            bench.raw(bench.frame_sizes())
            bench.other_raw(bench.frame_sizes())
        rates: dict[str, list[float]] = {t: [] for t in transports}
        pushed: dict[str, list[float]] = {t: [] for t in transports}
        raws: dict[str, list[float]] = {t: [] for t in transports}
        cpu: dict[str, list[tuple[float, float]]] = {t: [] for t in transports}
        raw_cpu: dict[str, list[tuple[float, float]]] = {t: [] for t in transports}
        others: dict[str, dict[str, list[float]]] = {t: {} for t in transports}  # other raw loopbacks
        copy = []
        for _ in range(repeats):
            for t, bench in benches.items():
                rate, push_rate, num_bytes, used = bench.transfer()
                rates[t].append(rate)
                pushed[t].append(push_rate)
                cpu[t].append(used)
                raw_rate, raw_used = bench.raw(bench.frame_sizes())
                raws[t].append(raw_rate)
                raw_cpu[t].append(raw_used)
                for kind, other_rate in bench.other_raw(bench.frame_sizes()):
                    others[t].setdefault(kind, []).append(other_rate)
            copy.append(memcpy_rate(num_bytes))
    finally:
        for bench in benches.values():
            bench.close()
    result: dict[str, Any] = {"kv_bytes_per_transfer": num_bytes, "memcpy_mib_s": copy}
    for t in transports:
        ratios = [r / raw for r, raw in zip(rates[t], raws[t])]
        result.update({f"{t}_transport_mib_s": rates[t], f"{t}_push_returned_mib_s": pushed[t],
                       f"{t}_raw_loopback_mib_s": raws[t], f"{t}_ratio_per_repeat": ratios,
                       f"{t}_over_raw_loopback": statistics.median(rates[t]) / statistics.median(raws[t]),
                       # CPU seconds per copy: (prefill's process, decode's process)
                       f"{t}_transport_cpu_s": cpu[t], f"{t}_raw_loopback_cpu_s": raw_cpu[t]})
        for kind, other_rates in others[t].items():  # tcp against the bare socket, tcp-stream against ZMQ, ...
            other_ratios = [r / raw for r, raw in zip(rates[t], other_rates)]
            result.update({f"{t}_raw_{kind}_mib_s": other_rates, f"{t}_ratio_to_raw_{kind}_per_repeat": other_ratios,
                           f"{t}_median_ratio_to_raw_{kind}": statistics.median(other_ratios)})
        result[f"{t}_median_ratio_per_repeat"] = statistics.median(ratios)
    return result


if __name__ == "__main__":
    main()
