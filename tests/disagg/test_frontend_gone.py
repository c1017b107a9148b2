"""A frontend that is gone leaves nothing running on separately run engines (`kvseal engine`):
each engine notices it (its connection closed, or silent past `--frontend-timeout-s`) and
ends its requests, prefill jobs and reservations, freeing their pages for other tenants.
Before, they ran on until `max_tokens` for a client nobody could reach, and a restarted
frontend could not abort them (it does not know their ids)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from marker_model import marker_prompt
from pd_harness import PdKeys, PdPair, TestFrontend
from pd_servers import KEYS, PdEngine, PdFrontend, assert_engines_clean, engine_integrity
from processes import wait_for
from test_handoff import args

from kvseal import SamplingParams
from kvseal.disagg.config import DEFAULT_FRONTEND_TIMEOUT_S, MIN_FRONTEND_TIMEOUT_S, NodeConfig
from kvseal.disagg.msgs import HelloMsg, ReservedMsg, ReserveMsg
from kvseal.disagg.role import FRONTEND_GONE
from kvseal.errors import ConfigError
from kvseal.messages.convert import params_to_msg
from kvseal.messages.msgs import OutputsMsg
from kvseal.models.loader import load_model

PROMPT = list(range(100, 130))
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
FOUND_WITHIN_S = 10.0  # well under the default --frontend-timeout-s (30 s): a closed connection is found at once


@pytest.fixture
def pair(llama_dir: Path, request: pytest.FixtureRequest) -> Iterator[PdPair]:
    """Engines whose --frontend-timeout-s is the test's parameter (the least it may be unless it has one)."""
    loaded = load_model(str(llama_dir), args(llama_dir).torch_dtype)
    pd = PdPair(args(llama_dir), args(llama_dir), loaded=loaded, reservation_timeout_s=120,
                frontend_timeout_s=getattr(request, "param", MIN_FRONTEND_TIMEOUT_S))
    yield pd
    pd.close()


@pytest.fixture
def another(pair: PdPair) -> Iterator[TestFrontend]:
    """Another frontend on decode, proving the frontend key, that says hello as kvseal's does
    (the pair's own never does)."""
    frontend = TestFrontend(pair.ctx, pair.decode.config.listen, pair.keys.frontend, pair.keys.decode.public)
    frontend.send(HelloMsg("another"))
    yield frontend
    frontend.socket.close(linger=0)  # before the pair's context ends


def reserve_from(pair: PdPair, frontend: TestFrontend, request_id: str) -> None:
    frontend.send(ReserveMsg(request_id, "alice", PROMPT, params_to_msg(GREEDY)))

    def reserved() -> bool:
        frontend.collect()
        return any(isinstance(m, ReservedMsg) and m.request_id == request_id for m in frontend.received)
    pair.pump(reserved, f"the reservation of {request_id}")


def pump_for(pair: PdPair, until: Any, what: str, within_s: float) -> None:
    """Run both engines until `until()`, failing after `within_s` of wall time."""
    end_s = time.monotonic() + within_s
    while not until():
        assert time.monotonic() < end_s, f"no {what} within {within_s:g} s"
        pair.pump(lambda: True, what)


@pytest.mark.parametrize("pair", [DEFAULT_FRONTEND_TIMEOUT_S], indirect=True)
def test_decode_releases_the_reservation_of_a_frontend_whose_connection_closed(pair: PdPair,
                                                                              another: TestFrontend) -> None:
    reserve_from(pair, another, "r-gone")
    kept = pair.reserve(PROMPT, GREEDY, tenant="bob")  # the test's own frontend, still connected
    table = pair.decode.steps.table
    another.socket.close(linger=0)
    pump_for(pair, lambda: table.by_request("r-gone") is None, "release of the gone frontend's reservation",
             FOUND_WITHIN_S)
    assert table.by_request(kept.request_id) is not None, "another frontend's reservation was ended"
    assert pair.decode.steps.counters.failures["aborted"] == 1
    pair.decode.check_integrity()


def test_a_silent_frontend_is_ended_after_the_timeout_and_served_again_when_it_speaks(pair: PdPair,
                                                                                     another: TestFrontend) -> None:
    """A connection left open with nobody behind it (a stopped process, a vanished host): its
    work ends after --frontend-timeout-s. A frontend that says hello again is a frontend again;
    one that never said hello (a tool, this test's own) promised no heartbeat and is not timed out."""
    stalled = another
    reserve_from(pair, stalled, "r-stalled")
    kept = pair.reserve(PROMPT, GREEDY, tenant="bob")
    table = pair.decode.steps.table
    pump_for(pair, lambda: table.by_request("r-stalled") is None, "release of the silent frontend's reservation",
             FOUND_WITHIN_S)
    time.sleep(MIN_FRONTEND_TIMEOUT_S + 0.5)
    pair.pump(lambda: True, "another turn")
    assert table.by_request(kept.request_id) is not None, "a frontend that said no hello was timed out"
    stalled.collect()
    ends = [o for m in stalled.received if isinstance(m, OutputsMsg) for o in m.outputs if o.finished]
    assert [(o.request_id, o.finish_reason, o.error) for o in ends] == [("r-stalled", "abort", FRONTEND_GONE)]
    stalled.send(HelloMsg("another"))
    reserve_from(pair, stalled, "r-back")  # served again


def stream(frontend: PdFrontend, tenant: str) -> int:
    """A long stream (the whole context) that runs until the frontend dies; the chunks it got."""
    body = {"prompt": marker_prompt(7, 40), "max_tokens": 1950, "temperature": 0, "ignore_eos": True,
            "stream": True}
    num_chunks = 0
    try:
        with httpx.stream("POST", f"{frontend.url}/v1/completions", json=body, timeout=60,
                          headers={"authorization": f"Bearer key-{tenant}"}) as response:
            for _ in response.iter_lines():
                num_chunks += 1
    except httpx.TransportError:
        pass  # the frontend was killed
    return num_chunks


def test_engines_end_the_requests_of_a_killed_frontend(marker_dir: Path, tmp_path: Path) -> None:
    """The reviewer's reproduction: two long streams on separate engines, the frontend SIGKILLed
    mid-stream. Both engines drain back to no page in use at once, not after max_tokens, and
    decode says in one line how many requests it ended."""
    flags = ["--kv-cache-tokens", "4096", "--max-model-len", "2048", "--kv-transport", "tcp-stream"]
    prefill = PdEngine("prefill", marker_dir, tmp_path, flags).start()
    decode = PdEngine("decode", marker_dir, tmp_path, flags).start()
    frontend = PdFrontend([prefill], [decode], marker_dir, tmp_path, KEYS)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        frontend.start().wait_healthy()
        with ThreadPoolExecutor(max_workers=2) as pool:
            streams = [pool.submit(stream, frontend, tenant) for tenant in ("alice", "bob")]
            wait_for(lambda: engine_integrity(decode).num_unfinished == 2, "both streams decoding")
            frontend.kill()
            killed_s = time.monotonic()
            assert all(s.result() > 0 for s in streams)
        assert_engines_clean(prefill, decode)
        assert time.monotonic() - killed_s < FOUND_WITHIN_S, "the engines ran on after their frontend died"
        wait_for(lambda: "is gone (its connection closed): ended the 2 request(s)" in decode.log(),
                 "decode's line on the gone frontend")
    finally:
        frontend.kill()
        prefill.terminate()
        decode.terminate()


@pytest.mark.parametrize("timeout_s", [0.0, 0.5, 1.9, float("nan")])
def test_a_frontend_timeout_a_healthy_frontend_could_miss_is_refused(timeout_s: float) -> None:
    """Under four heartbeats (0.5 s each) a busy but healthy frontend would lose its requests."""
    with pytest.raises(ConfigError, match="--frontend-timeout-s must be >= 2"):
        NodeConfig(role="decode", listen="127.0.0.1:1", frontend_timeout_s=timeout_s,
                   link_keys=PdKeys.ephemeral().of_decode())
