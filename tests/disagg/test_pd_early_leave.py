"""Clients that leave before decode's reservation came back (the request never reached prefill),
served over the HTTP frontend in PD mode: each is audited at once as `client_disconnected`, its
tenant's concurrency slots come back at once, so a run of them by a tenant with a small limit
meets no 429, and decode's pages return to none used.

The server runs in this process (the app, `PdClient`, the audit log), the two engines on a
thread of their own, so the test can hold them while a client sends its request and leaves: the
abort then reaches decode right behind the reservation, as when a client drops its connection
within milliseconds. Over NIXL decode's drain (the wait for writes that might still land) is set
far past every bounded wait here: only the frontend's word that no prefill engine was asked can
free the reservation in time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from pd_harness import PdPair
from processes import WAIT_DEADLINE_S, free_port
from test_handoff import args
from transports import NIXL

from kvseal.disagg.frontend import PdClient
from kvseal.disagg.link_keys import EngineEndpoint
from kvseal.server.app import build_app
from kvseal.server.audit import AuditLog
from kvseal.server.auth import ApiKeyTable
from kvseal.server.config import ServerConfig
from kvseal.server.metrics import ServerMetrics
from kvseal.server.prompts import PromptEncoder
from kvseal.server.state import AppState

NEVER_DRAINED_S = 600.0  # decode's NIXL drain: far past every wait below
MAX_CONCURRENT = 3  # alice's limit: one request with n=3 fills it
PROMPT = " ".join(f"w{6 + i}" for i in range(100))  # 100 tokens, as the reviewer's clients sent
POLL_S = 0.005


class EngineThread:
    """Both engines' loops on one thread, as their processes would run them. `hold` keeps them
    between two turns (taking `lock`), `resume` lets them run again."""

    def __init__(self, pair: PdPair) -> None:
        self.pair = pair
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pd-engines", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                self.pair.prefill.loop.run_once(idle_poll_ms=1)
                self.pair.decode.loop.run_once(idle_poll_ms=1)
            time.sleep(0.0002)  # room for `hold` to take the lock

    def hold(self) -> None:
        assert self.lock.acquire(timeout=WAIT_DEADLINE_S), "the engines never finished a turn"

    def resume(self) -> None:
        self.lock.release()

    def read(self, what: Callable[[], Any]) -> Any:
        """`what()` between two turns of the engines."""
        with self.lock:
            return what()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=WAIT_DEADLINE_S)
        assert not self._thread.is_alive(), "the engine thread did not stop"


async def until(condition: Callable[[], Any], what: str) -> Any:
    """Poll `condition` on the event loop (the server keeps serving); fail after WAIT_DEADLINE_S."""
    deadline = time.monotonic() + WAIT_DEADLINE_S
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"gave up after {WAIT_DEADLINE_S:g} s waiting for {what}")


class Served:
    """The HTTP frontend over `pair`'s engines, in this process, with alice's small limit."""

    def __init__(self, state: AppState, pd: PdClient, engines: EngineThread, port: int, audit_path: Path) -> None:
        self.state, self.pd, self.engines, self.port, self.audit_path = state, pd, engines, port, audit_path

    def audit_records(self) -> list[dict[str, Any]]:
        if not self.audit_path.exists():
            return []
        return [json.loads(line) for line in self.audit_path.read_text().splitlines() if line.strip()]

    def decode_pages_used(self) -> int:
        decode = self.engines.pair.decode
        return int(self.engines.read(lambda: decode.engine.kv.num_used_pages + decode.steps.num_reservations()))

    async def leave_before_the_reservation(self, n: int) -> None:
        """Send a completion with `n` choices while the engines are held, drop the connection once
        the frontend submitted it, and let the engines run only once the frontend has aborted
        it: decode reserves, then reads the abort right behind."""
        self.engines.hold()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            answer = asyncio.create_task(reader.read(1))  # done only if the server answered (a 429)
            try:
                writer.write(completion(n))
                await writer.drain()
                await until(lambda: self.pd.num_in_flight == n or answer.done(), "the request's submission")
                assert not answer.done(), f"answered before it reached the engines: {await answer!r}" \
                                          f"{await reader.read(1000)!r}"
            finally:
                writer.close()
                answer.cancel()
            await until(lambda: all(r.is_aborted for r in self.pd._routes.values()), "the frontend's abort")
        finally:
            self.engines.resume()


def completion(n: int) -> bytes:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 8, "n": n}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer key-alice\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    return head + body


@contextlib.asynccontextmanager
async def served(pair: PdPair, llama_dir: Path, tmp_path: Path) -> AsyncIterator[Served]:
    engines = EngineThread(pair)
    pd = PdClient([EngineEndpoint(pair.prefill.config.listen, pair.keys.prefill.public)],
                  [EngineEndpoint(pair.decode.config.listen, pair.keys.decode.public)], str(llama_dir),
                  pair.keys.frontend)
    keys_path = tmp_path / "keys.json"
    keys_path.write_text(json.dumps({"key-alice": {"tenant": "alice", "max_concurrent_requests": MAX_CONCURRENT}}))
    audit = AuditLog(str(tmp_path / "audit.jsonl"), include_prompts=False)
    server, serving, state = None, None, None
    try:
        info = await pd.start(timeout_s=WAIT_DEADLINE_S)
        state = AppState(ServerConfig(), pd, info, PromptEncoder.load(info.tokenizer_path),
                         ApiKeyTable.load(str(keys_path)), ServerMetrics(), audit)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, loop="none",
                                               lifespan="off", log_config=None, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        await until(lambda: server is not None and server.started, "the server to listen")
        yield Served(state, pd, engines, port, tmp_path / "audit.jsonl")
    finally:
        await pd.shutdown(timeout_s=1)  # first: it ends what a failed test left waiting on decode
        if server is not None and serving is not None:
            server.should_exit = True
            await serving
        if state is not None:
            state.prompts.close()
        engines.stop()
        audit.close()


@pytest.fixture(params=["tcp-stream", NIXL])
def pair(llama_dir: Path, request: pytest.FixtureRequest) -> Iterator[PdPair]:
    pd = PdPair(args(llama_dir), args(llama_dir), kv_transport=request.param, transfer_drain_s=NEVER_DRAINED_S)
    yield pd
    pd.close()


def test_clients_that_leave_before_the_reservation_are_audited_and_freed_at_once(
        pair: PdPair, llama_dir: Path, tmp_path: Path) -> None:
    """One request after another, n=3 then n=1, each client gone before decode's reservation
    came back: each is audited `aborted` / `client_disconnected` (a code `kvseal audit --reason`
    finds) as soon as decode reports it; alice's slots are back before the next one, so none of
    them meets her limit (n=3 takes all 3); decode's pages return to none used. Nothing waits
    for the drain."""
    async def scenario() -> list[dict[str, Any]]:
        async with served(pair, llama_dir, tmp_path) as server:
            for index, n in enumerate([3, 1, 3, 3, 1, 3]):
                await server.leave_before_the_reservation(n)
                records = await until(lambda i=index: server.audit_records()[i:], f"request {index}'s audit line")
                assert len(records) == 1, records
                await until(lambda: server.state.gate.num_tenants_in_flight() == 0, f"request {index}'s slots")
                await until(lambda: server.decode_pages_used() == 0, f"decode's pages after request {index}")
            return server.audit_records()

    records = asyncio.run(scenario())
    assert len(records) == 6
    for record in records:
        assert (record["tenant"], record["outcome"], record["reason"]) == ("alice", "aborted", "client_disconnected"), \
            record
    pair.assert_clean()
