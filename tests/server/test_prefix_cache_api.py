"""The prefix cache over HTTP: `usage.prompt_tokens_details.cached_tokens` in every response,
per-tenant hit and query counters in /metrics, cached tokens in the audit line, and the
namespace (I5) taken from the authenticated tenant: another tenant's identical prompt never
hits, unless a test-only fault drops the namespace from the key, which the check detects."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
from server_process import KEYS, ServerProcess

ALICE = {"Authorization": "Bearer key-alice"}
BOB = {"Authorization": "Bearer key-bob"}


def _system(first_word: int) -> str:
    return " ".join(f"w{i}" for i in range(first_word, first_word + 40))


def _complete(server: ServerProcess, headers: dict[str, str], prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0} | extra
    response = httpx.post(f"{server.base_url}/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _cached(response: dict[str, Any]) -> int:
    return int(response["usage"]["prompt_tokens_details"]["cached_tokens"])


def _labeled(server: ServerProcess, name: str, tenant: str) -> float:
    match = re.search(rf'^{name}{{tenant="{tenant}"}} (\S+)$', server.metrics_text(), re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_same_tenant_hits_another_tenant_does_not(server: ServerProcess) -> None:
    system = _system(100)
    hits_before = _labeled(server, "kvseal_prefix_cache_hits_total", "alice")
    assert _cached(_complete(server, ALICE, system + " w1")) == 0
    second = _complete(server, ALICE, system + " w2 w3")
    assert 0 < _cached(second) < second["usage"]["prompt_tokens"]
    assert _cached(_complete(server, BOB, system + " w1")) == 0
    assert _labeled(server, "kvseal_prefix_cache_hits_total", "alice") - hits_before >= _cached(second)
    assert _labeled(server, "kvseal_prefix_cache_queries_total", "bob") > 0


def test_a_cache_salt_splits_a_tenants_cache(server: ServerProcess) -> None:
    """vLLM's cache_salt: the same salt shares the tenant's cached pages, another salt (or none)
    does not, and another tenant with the same salt never hits (I5)."""
    system = _system(300)
    assert _cached(_complete(server, ALICE, system + " w1", cache_salt="user-1")) == 0
    assert _cached(_complete(server, ALICE, system + " w2", cache_salt="user-1")) > 0
    assert _cached(_complete(server, ALICE, system + " w2", cache_salt="user-2")) == 0
    assert _cached(_complete(server, ALICE, system + " w3")) == 0
    assert _cached(_complete(server, BOB, system + " w2", cache_salt="user-1")) == 0
    refused = httpx.post(f"{server.base_url}/completions", json={"prompt": "w5", "cache_salt": ""}, headers=ALICE,
                         timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt"


def test_cached_tokens_in_chat_and_streams(server: ServerProcess) -> None:
    system = _system(200)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "w1"}]
    body = {"messages": messages, "max_tokens": 2, "temperature": 0}
    first = httpx.post(f"{server.base_url}/chat/completions", json=body, headers=ALICE, timeout=60)
    second = httpx.post(f"{server.base_url}/chat/completions", json=body, headers=ALICE, timeout=60)
    assert first.status_code == second.status_code == 200
    assert _cached(second.json()) > 0
    request_id = second.headers["x-request-id"]
    assert server.audit_for(request_id)["cached_tokens"] == _cached(second.json())
    stream_body = body | {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=stream_body, headers=ALICE,
                      timeout=60) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: {")]
    usage = json.loads(events[-1][6:])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_completions_stream_reports_cached_tokens(server: ServerProcess) -> None:
    system = _system(300)
    _complete(server, ALICE, system)
    body = {"prompt": system, "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, headers=ALICE, timeout=60) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: {")]
    assert json.loads(events[-1][6:])["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def _bob_cached_tokens_after_alice(server: ServerProcess) -> int:
    """The cross-tenant check: bob sends alice's exact prompt; his cached tokens must be 0."""
    system = _system(400)
    _complete(server, ALICE, system)
    return _cached(_complete(server, BOB, system))


def test_dropping_the_namespace_is_detected(server: ServerProcess, server_model_dir: Path,
                                            tmp_path: Path) -> None:
    assert _bob_cached_tokens_after_alice(server) == 0
    broken = ServerProcess(server_model_dir, tmp_path, keys=KEYS,
                           faults=["drop_cache_namespace", "bypass_kv_checks"]).start()
    try:
        assert _bob_cached_tokens_after_alice(broken) > 0, "the cross-tenant check must see the hit"
    finally:
        broken.terminate()

