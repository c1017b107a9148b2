"""PD benchmark (not a test): TTFT colocated vs PD, and KV transfer throughput vs raw loopback.

In one process, on the default model (SmolLM2-135M-Instruct GGUF) unless --model is given:

1. TTFT for --prompt-len-token prompts: a colocated `LLMEngine` (add the request, step until
   the first token) against a prefill and a decode engine over loopback TCP (reserve, prefill,
   push KV, commit, verify, first token at the frontend), alternating, --repeats times each.
2. KV transfer throughput, per transport: the same prompt's KV (every layer, K and V) pushed
   into a decode reservation and imported there (stage, move, land, record), against that
   library's own raw loopback copy of the same bytes in the same run: for tcp, the same frames
   over a bare ZMQ DEALER->ROUTER pair (no staging, no import); for nixl, one NIXL WRITE of the
   same number of bytes between two registered buffers, with its notification (no staging, no
   import); and against one in-process memcpy of those bytes.

    python bench/pd.py                  # 2,048-token prompts, 3 repeats, tcp and nixl
    python bench/pd.py --repeats 5 --prompt-len 1024 --transports nixl
    python bench/pd.py --skip-ttft      # transfer throughput only
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import zmq

from kvseal.config import EngineArgs
from kvseal.disagg.msgs import PdMsg, PrefillMsg, ReservedMsg, ReserveMsg, decode, encode
from kvseal.disagg.node import EngineNode, NodeConfig
from kvseal.disagg.transport import KINDS, PushPlan, staged_pages
from kvseal.engine.engine import LLMEngine
from kvseal.kvcache.prefix_cache import namespace_of
from kvseal.messages.convert import params_to_msg
from kvseal.messages.msgs import AbortMsg, OutputsMsg
from kvseal.models.loader import load_model
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
        self.ctx = zmq.Context()
        self.kv_transport = kv_transport
        self.prefill = EngineNode(LLMEngine(args, loaded), NodeConfig("prefill", free_address(), kv_transport),
                                  self.ctx)
        # A 2,048-token prefill takes a minute on a loaded 2-core host: longer than the default timeout.
        self.decode = EngineNode(LLMEngine(args, loaded), NodeConfig("decode", free_address(), kv_transport,
                                                                     reservation_timeout_s=PUMP_DEADLINE_S),
                                 self.ctx)
        self.to_prefill, self.to_decode = self._dealer(self.prefill), self._dealer(self.decode)
        self._ids = iter(range(10**9))

    def _dealer(self, node: EngineNode) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://{node.config.listen}")
        return sock

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
        # A namespace of its own per request: no prefix-cache hit, every handoff moves the whole prompt.
        self.to_decode.send(encode(ReserveMsg(request_id, "bench", prompt, params_to_msg(PARAMS),
                                              namespace_of(request_id))))
        reserved = self.pump_until(self.to_decode, lambda m: isinstance(m, ReservedMsg))
        assert isinstance(reserved, ReservedMsg)
        return reserved

    def first_token(self, prompt: list[int]) -> None:
        r = self.reserve(prompt)
        self.to_prefill.send(encode(PrefillMsg(r.request_id, "bench", prompt, params_to_msg(PARAMS), r.transfer_id,
                                               self.decode.config.listen, self.decode.instance_id, r.kv_address,
                                               r.pages, namespace_of(r.request_id), r.num_cached_tokens)))
        self.pump_until(self.to_decode, lambda m: isinstance(m, OutputsMsg) and any(
            o.request_id == r.request_id and o.new_token_ids for o in m.outputs))


def ttft_colocated(engine: LLMEngine, prompt: list[int], n: int) -> float:
    start = time.perf_counter()
    engine.add_request(f"colocated-{n}", prompt, PARAMS)
    while not any(o.new_token_ids for o in engine.step()):
        pass
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def ttft_pd(pair: Pair, prompt: list[int]) -> float:
    start = time.perf_counter()
    pair.first_token(prompt)
    return time.perf_counter() - start


def transfer_rate(pair: Pair, prompt: list[int]) -> tuple[float, int]:
    """Push a computed-looking prompt's KV from prefill's pool into a decode reservation."""
    r = pair.reserve(prompt)
    num_layers = len(pair.prefill.engine.kv.pool.k)
    num_pages = len(r.pages)
    plan = PushPlan(r.transfer_id, list(range(num_pages)), [len(prompt)] * num_layers, r.kv_address, r.pages)
    receiver = pair.decode.steps.receiver  # type: ignore[attr-defined]
    sender = pair.prefill.transport  # prefill's own: its link (or NIXL peer) is set up by the warm-up
    start = time.perf_counter()
    num_bytes = sender.push(plan, pair.prefill.engine.kv.pool)  # type: ignore[union-attr]
    receiver.sender_done(r.transfer_id)  # what the commit tells decode
    while True:
        pair.decode.loop.run_once(idle_poll_ms=0)
        landing = receiver.landed(r.transfer_id)
        if all(landing.covered_prefix(layer, kind) >= len(prompt) for layer in range(num_layers) for kind in KINDS):
            break
    elapsed = time.perf_counter() - start
    pair.to_decode.send(encode(AbortMsg(r.request_id, "bench", "transfer measured")))  # release the pages
    pair.pump_until(pair.to_decode, lambda m: isinstance(m, OutputsMsg))
    return num_bytes / elapsed / MiB, num_bytes


def raw_zmq_rate(frames: list[bytes]) -> float:
    """The same frames over a bare DEALER->ROUTER loopback connection, received in full."""
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    address = free_address()
    router.bind(f"tcp://{address}")
    dealer.connect(f"tcp://{address}")
    dealer.send(b"hello")
    router.recv_multipart()
    total = sum(len(f) for f in frames)
    start = time.perf_counter()
    for frame in frames:
        dealer.send_multipart([b"h", frame], copy=False)
    received = 0
    while received < total:
        received += len(router.recv_multipart()[2])
    elapsed = time.perf_counter() - start
    router.close(0)
    dealer.close(0)
    ctx.term()
    return total / elapsed / MiB


def raw_nixl_rate(num_bytes: int) -> float:
    """One NIXL WRITE of `num_bytes` between two agents' registered buffers (one descriptor, as
    a reservation of consecutive pages is), done when the receiver has the notification."""
    from kvseal.disagg.nixl import make_agent

    sender, receiver = make_agent("bench-raw-sender", "127.0.0.1"), make_agent("bench-raw-receiver", "127.0.0.1")
    src, dst = torch.empty(num_bytes, dtype=torch.uint8).random_(), torch.zeros(num_bytes, dtype=torch.uint8)
    regs = sender.register_memory(src), receiver.register_memory(dst)
    remote = sender.add_remote_agent(receiver.get_agent_metadata())
    rows = np.array([[src.data_ptr(), num_bytes, 0]], dtype=np.uint64)
    remote_rows = np.array([[dst.data_ptr(), num_bytes, 0]], dtype=np.uint64)
    rates = []
    for n in range(2):  # the first pays for the connection
        note = f"raw-{n}".encode()
        start = time.perf_counter()
        handle = sender.initialize_xfer("WRITE", sender.get_xfer_descs(rows, "DRAM"),
                                        sender.get_xfer_descs(remote_rows, "DRAM"), remote, note)
        state = sender.transfer(handle)
        while state == "PROC":
            state = sender.check_xfer_state(handle)
        assert state == "DONE", state
        while not any(note in msgs for msgs in receiver.get_new_notifs().values()):
            pass
        rates.append(num_bytes / (time.perf_counter() - start) / MiB)
        sender.release_xfer_handle(handle)
    assert torch.equal(src, dst)
    sender.deregister_memory(regs[0])
    receiver.deregister_memory(regs[1])
    return rates[-1]


def memcpy_rate(num_bytes: int) -> float:
    src, dst = torch.empty(num_bytes, dtype=torch.uint8).random_(), torch.empty(num_bytes, dtype=torch.uint8)
    dst.copy_(src)
    start = time.perf_counter()
    dst.copy_(src)
    return num_bytes / (time.perf_counter() - start) / MiB


def frames_of(pair: Pair, prompt_len: int) -> list[bytes]:
    pool = pair.prefill.engine.kv.pool
    pages = list(range(-(-prompt_len // pool.page_size)))
    frames = []
    for layer in range(len(pool.k)):
        for data in staged_pages(pool, pages, layer, prompt_len):
            frames.append(data.view(torch.uint8).numpy().tobytes())
    return frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transports", default="tcp,nixl", help="comma-separated KV transports to measure")
    parser.add_argument("--skip-ttft", action="store_true", help="measure only the KV transfer throughput")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ns = parser.parse_args()
    if ns.threads is not None:
        torch.set_num_threads(ns.threads)
    args = EngineArgs(model=ns.model, dtype=ns.dtype, max_model_len=ns.prompt_len + 16,
                      kv_cache_tokens=4 * (ns.prompt_len + 16))
    loaded = load_model(args.model, args.torch_dtype)
    transports = ns.transports.split(",")
    pairs = {t: Pair(args, loaded, t) for t in transports}
    prompt = [int(t) for t in torch.randint(100, loaded.config.vocab_size - 100, (ns.prompt_len,),
                                            generator=torch.Generator().manual_seed(0))]
    result: dict[str, Any] = {
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "model": str(loaded.path), "dtype": args.dtype, "prompt_len": ns.prompt_len, "repeats": ns.repeats,
    }
    if not ns.skip_ttft:
        colocated, pair = LLMEngine(args, loaded), pairs[transports[0]]
        ttft_colocated(colocated, prompt, -1)  # warm-up: first-use kernel setup on both paths
        ttft_pd(pair, prompt)
        colocated_s, pd_s = [], []
        for n in range(ns.repeats):
            colocated_s.append(ttft_colocated(colocated, prompt, n))
            pd_s.append(ttft_pd(pair, prompt))
        result.update({"ttft_transport": transports[0], "ttft_colocated_s": colocated_s, "ttft_pd_s": pd_s,
                       "ttft_pd_over_colocated": statistics.median(pd_s) / statistics.median(colocated_s)})
    for pair in pairs.values():
        transfer_rate(pair, prompt)  # warm-up: connections, first registrations
    rates: dict[str, list[float]] = {t: [] for t in transports}
    raws: dict[str, list[float]] = {t: [] for t in transports}
    copy = []
    for _ in range(ns.repeats):
        for t, pair in pairs.items():
            rate, num_bytes = transfer_rate(pair, prompt)
            rates[t].append(rate)
            raws[t].append(raw_zmq_rate(frames_of(pair, ns.prompt_len)) if t == "tcp" else raw_nixl_rate(num_bytes))
        copy.append(memcpy_rate(num_bytes))
    result["kv_bytes_per_transfer"] = num_bytes
    result["memcpy_mib_s"] = copy
    for t in transports:
        result[f"{t}_transport_mib_s"] = rates[t]
        result[f"{t}_raw_loopback_mib_s"] = raws[t]
        result[f"{t}_over_raw_loopback"] = statistics.median(rates[t]) / statistics.median(raws[t])
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
