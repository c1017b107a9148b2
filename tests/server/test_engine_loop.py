"""The engine process's loop, in-process over real ZMQ sockets and a real engine.

It re-checks admission (I1) itself, turns a rejection into a message (never a crash), ends
every request with exactly one terminal report, and only lets a tenant abort its own requests.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from processes import WAIT_DEADLINE_S

from kvseal.config import EngineArgs
from kvseal.engine.colocated import colocated_loop
from kvseal.engine.engine import LLMEngine
from kvseal.messages.codec import decode_from_engine, encode
from kvseal.messages.convert import params_to_msg
from kvseal.messages.msgs import (
    AbortMsg,
    AddRequestMsg,
    EngineStatsMsg,
    EngineStoppedMsg,
    FromEngineMsg,
    OutputsMsg,
    RequestOutputMsg,
    RequestRejectedMsg,
    ShutdownMsg,
    ToEngineMsg,
)
from kvseal.types import SamplingParams

_addresses = itertools.count()


class Harness:
    """A frontend's two sockets around an `EngineLoop`, stepped by hand."""

    def __init__(self, engine: LLMEngine) -> None:
        self.ctx = zmq.Context()
        n = next(_addresses)
        self.to_engine = self.ctx.socket(zmq.PUSH)
        self.to_engine.bind(f"inproc://to-{n}")
        self.from_engine = self.ctx.socket(zmq.PULL)
        self.from_engine.bind(f"inproc://from-{n}")
        inbox, outbox = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PUSH)
        inbox.connect(f"inproc://to-{n}")
        outbox.connect(f"inproc://from-{n}")
        self.engine = engine
        self.loop = colocated_loop(engine, inbox, outbox)

    def send(self, msg: ToEngineMsg) -> None:
        self.to_engine.send(encode(msg))

    def run(self, iterations: int = 1) -> list[FromEngineMsg]:
        for _ in range(iterations):
            self.loop.run_once(idle_poll_ms=0)
        received = []
        while self.from_engine.poll(0):
            received.append(decode_from_engine(self.from_engine.recv()))
        return received

    def run_until_finished(self, request_id: str) -> list[RequestOutputMsg]:
        """Run until the request's final output; fail after 200 iterations (those spent waiting
        for a grammar compiling in a worker process do not count, up to WAIT_DEADLINE_S)."""
        outputs: list[RequestOutputMsg] = []
        num_turns = 0
        deadline_s = time.monotonic() + WAIT_DEADLINE_S
        while num_turns < 200:
            outputs += [o for m in self.run() if isinstance(m, OutputsMsg) for o in m.outputs
                        if o.request_id == request_id]
            if outputs and outputs[-1].finished:
                return outputs
            stats = self.engine.grammar_stats()
            if not ((stats.num_running or stats.num_queued) and time.monotonic() < deadline_s):
                num_turns += 1
        raise AssertionError(f"{request_id} did not finish in 200 iterations")

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def engine(server_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(server_model_dir), dtype="float32", kv_cache_tokens=256, page_size=4,
                                max_model_len=128, check_kv=True))


@pytest.fixture
def harness(engine: LLMEngine) -> Iterator[Harness]:
    h = Harness(engine)
    yield h
    h.close()
    engine.check_integrity()
    assert not engine.has_unfinished()


def add(request_id: str, prompt: list[int], tenant: str = "alice", **params: object) -> AddRequestMsg:
    sampling = SamplingParams(**{"max_tokens": 4, "temperature": 0.0, **params})  # type: ignore[arg-type]
    return AddRequestMsg(request_id, tenant, prompt, params_to_msg(sampling))


def test_runs_a_request_to_one_terminal_output(harness: Harness) -> None:
    harness.send(add("r1", [10, 11, 12, 13, 14]))
    outputs = harness.run_until_finished("r1")
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert sum(len(o.new_token_ids) for o in outputs) == 4 == outputs[-1].num_output_tokens
    assert outputs[-1].finish_reason == "length" and outputs[-1].tenant == "alice"
    assert outputs[-1].num_pages_reserved == 2  # 5 prompt + 3 computed output tokens, pages of 4


def test_engine_rechecks_admission_and_reports_rejection(harness: Harness) -> None:
    harness.send(add("long", list(range(10, 10 + 129))))
    harness.send(add("overflow", [10, 11], max_tokens=127))
    harness.send(add("bad-token", [10, 99_999]))
    messages = harness.run()
    rejected = {m.request_id: m for m in messages if isinstance(m, RequestRejectedMsg)}
    assert rejected["long"].code == rejected["overflow"].code == "context_length_exceeded"
    assert rejected["long"].http_status == 400 and "128" in rejected["long"].message
    assert rejected["bad-token"].code == "invalid_parameter"
    assert not harness.engine.has_unfinished()
    stats = [m for m in messages if isinstance(m, EngineStatsMsg)][-1]
    assert stats.num_pages_used == 0 and stats.num_running == stats.num_waiting == 0


def test_invalid_sampling_params_are_a_rejection_not_a_crash(harness: Harness) -> None:
    good = add("bad-params", [10, 11])
    harness.send(AddRequestMsg("bad-params", "alice", [10, 11], msgspec.structs.replace(good.params, top_p=0.0)))
    (rejected,) = [m for m in harness.run() if isinstance(m, RequestRejectedMsg)]
    assert rejected.code == "invalid_parameter" and rejected.param == "top_p"


def test_only_the_owning_tenant_can_abort(harness: Harness) -> None:
    harness.send(add("r2", [10, 11, 12], max_tokens=100))
    harness.run(2)
    harness.send(AbortMsg("r2", "mallory", "not yours"))
    assert harness.engine.scheduler.find("r2") is not None
    harness.send(AbortMsg("r2", "alice", "client_disconnected"))
    outputs = harness.run_until_finished("r2")
    assert outputs[-1].finish_reason == "abort" and outputs[-1].error == "client_disconnected"
    assert outputs[-1].num_pages_reserved >= 1
    assert harness.engine.kv.num_used_pages == 0


def test_shutdown_aborts_everything_and_says_so(harness: Harness) -> None:
    harness.send(add("r3", [10, 11], max_tokens=100))
    harness.send(add("r4", [12, 13], tenant="bob", max_tokens=100))
    harness.run(2)
    harness.send(ShutdownMsg("server_shutdown"))
    messages = harness.run()
    outputs = [o for m in messages if isinstance(m, OutputsMsg) for o in m.outputs if o.finished]
    assert {(o.request_id, o.finish_reason, o.error) for o in outputs} == {
        ("r3", "abort", "server_shutdown"), ("r4", "abort", "server_shutdown")}
    assert isinstance(messages[-1], EngineStoppedMsg) and messages[-1].num_aborted == 2
    assert harness.loop.is_stopped
