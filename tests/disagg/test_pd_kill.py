"""Engines die; the frontend fails their requests with errors in bounded time, the survivors
release what those requests held, and an engine restarted at the same address is used again
without restarting the frontend."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from marker_model import make_marker_model
from pd_servers import PdEngine, PdFrontend, assert_engines_clean
from server_process import wait_for
from test_pd_incident import KEYS, Result, send

# Small prefill chunks and long prompts: a request spends many steps in prefill.
FLAGS = ["--kv-cache-tokens", "8192", "--max-model-len", "2048", "--max-num-batched-tokens", "16"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PdEngine, PdEngine, PdFrontend]]:
    workdir = tmp_path_factory.mktemp("pd-kill")
    model = make_marker_model(tmp_path_factory.mktemp("models") / "marker")
    prefill = PdEngine("prefill", model, workdir, FLAGS).start()
    decode = PdEngine("decode", model, workdir, FLAGS).start()
    prefill.wait_ready()
    decode.wait_ready()
    frontend = PdFrontend([prefill], [decode], model, workdir, KEYS).start().wait_healthy()
    try:
        yield prefill, decode, frontend
    finally:
        frontend.terminate()
        prefill.terminate()
        decode.terminate()


def assert_errors(results: list[Result]) -> None:
    """Every request ended with an error status: never 200 with a finish reason."""
    assert results and all(r.status >= 500 and r.text == "" for r in results), results


def test_prefill_killed_mid_transfer(setup: tuple[PdEngine, PdEngine, PdFrontend]) -> None:
    prefill, decode, frontend = setup
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures: list[Future[Result]] = [pool.submit(send, frontend, "alice", 1500) for _ in range(4)]
        wait_for(lambda: frontend.metric("kvseal_pd_reservations", role="decode") >= 3, "decode's reservations")
        prefill.kill()
        results = [f.result() for f in futures]
    assert_errors(results)
    assert_engines_clean(decode)  # the reservations were released; decode holds nothing
    assert frontend.health() == 503
    prefill.start().wait_ready()  # the same address, a new instance
    frontend.wait_healthy()
    ok = send(frontend, "bob", 40)
    assert ok.status == 200 and ok.text.split() == [f"w{ok.marker}"] * 6
    assert_engines_clean(prefill, decode)


def test_decode_killed(setup: tuple[PdEngine, PdEngine, PdFrontend]) -> None:
    prefill, decode, frontend = setup
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(send, frontend, "alice", 1500) for _ in range(4)]
        wait_for(lambda: frontend.metric("kvseal_pd_reservations", role="decode") >= 3, "decode's reservations")
        decode.kill()
        results = [f.result() for f in futures]
    assert_errors(results)
    assert frontend.health() == 503
    assert_engines_clean(prefill)  # prefill freed what it held for the dead decode's requests
    decode.start().wait_ready()
    frontend.wait_healthy()
    ok = send(frontend, "bob", 40)
    assert ok.status == 200 and ok.text.split() == [f"w{ok.marker}"] * 6
    assert_engines_clean(prefill, decode)
