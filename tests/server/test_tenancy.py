"""Tenants: concurrent tenants get what they get alone; the namespace comes from the server.

The concurrency tests run in the default configuration (the shared server) and in checked mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from server_process import ISOLATION_MODES, KEYS, ServerProcess, client_for

from kvseal.messages.msgs import AddRequestMsg
from kvseal.types import Request, SamplingParams, namespace_of

PROMPTS = {
    "alice": ["w100 w101 w102", "w7 " * 40, "w300 w301 w302 w303 w304 w305 w306"],
    "bob": ["w200 w201", "w9 w8 w7 w6 w5 w4 w3", "w450 " * 25],
}


@pytest.fixture(scope="module", params=list(ISOLATION_MODES))
def mode_server(request: pytest.FixtureRequest, server: ServerProcess, server_model_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    if not ISOLATION_MODES[request.param]:
        yield server  # the shared server runs the default configuration
        return
    proc = ServerProcess(server_model_dir, tmp_path_factory.mktemp(request.param), keys=KEYS,
                         extra_args=ISOLATION_MODES[request.param]).start()
    yield proc
    proc.terminate()


def _complete(client: openai.OpenAI, model: str, prompt: str) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
    assert out.choices[0].finish_reason == "length"
    return out.choices[0].text


def test_concurrent_tenants_get_their_solo_greedy_outputs(mode_server: ServerProcess) -> None:
    server = mode_server
    clients = {"alice": client_for(server, "key-alice"), "bob": client_for(server, "key-bob")}
    jobs = [(tenant, prompt) for tenant, prompts in PROMPTS.items() for prompt in prompts]
    alone = {job: _complete(clients[job[0]], server.model_name, job[1]) for job in jobs}
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        together = dict(zip(jobs, pool.map(lambda job: _complete(clients[job[0]], server.model_name, job[1]), jobs),
                            strict=True))
    assert together == alone


def test_concurrent_streams_do_not_mix(mode_server: ServerProcess) -> None:
    server = mode_server
    alice, bob = client_for(server, "key-alice"), client_for(server, "key-bob")

    def stream(client: openai.OpenAI, prompt: str) -> str:
        chunks = client.completions.create(model=server.model_name, prompt=prompt, max_tokens=20, temperature=0,
                                           stream=True)
        return "".join(c.choices[0].text for c in chunks)

    jobs = [(alice, "w100 w101 w102"), (bob, "w200 w201"), (alice, "w7 w7 w7"), (bob, "w450 w451")]
    alone = [stream(c, p) for c, p in jobs]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        together = list(pool.map(lambda job: stream(*job), jobs))
    assert together == alone


def test_cache_namespace_is_derived_from_the_tenant_only() -> None:
    """I5 by construction: a request's namespace is its tenant's; no caller or message gives one."""
    params = SamplingParams()
    assert Request("r1", "alice", [1], params).cache_namespace == Request("r2", "alice", [2], params).cache_namespace
    assert Request("r1", "alice", [1], params).cache_namespace == namespace_of("alice")
    assert namespace_of("alice") != namespace_of("bob")
    assert namespace_of("ab") != namespace_of("a")  # framed, not just concatenated
    assert len(namespace_of("alice")) == 64
    with pytest.raises(TypeError):
        Request("r1", "alice", [1], params, cache_namespace=namespace_of("bob"))  # type: ignore[call-arg]
    assert "cache_namespace" not in AddRequestMsg.__struct_fields__
