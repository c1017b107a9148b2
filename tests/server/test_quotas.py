"""Quotas and metering against a real server: requests and tokens per minute answered with 429
and OpenAI's x-ratelimit-* headers at the right counts, recovery once the bucket refills, limits
changed by a reload, and per-tenant token counters equal to the responses' usage.

The buckets refill continuously (`kvseal.server.rate_limits`; the exact arithmetic is pinned on
a test clock in test_rate_limits.py). Here the expected counts allow for what refilled while
the test ran, measured by the test itself, so no assertion depends on how fast the host is.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import KEYS, ServerProcess
from test_admin import reload, write_keys
from test_http_errors import error_of

RPM = 6  # one request refills every 10 s
TPM = 30  # one token refills every 2 s
QUOTA_KEYS = KEYS | {"key-rpm": {"tenant": "rpm", "requests_per_minute": RPM},
                     "key-tpm": {"tenant": "tpm", "tokens_per_minute": TPM},
                     "key-stream": {"tenant": "stream", "requests_per_minute": 100}}


@pytest.fixture(scope="module")
def quota_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(server_model_dir, tmp_path_factory.mktemp("quota-server"), keys=QUOTA_KEYS).start()
    yield proc
    proc.terminate()


def complete(server: ServerProcess, key: str, prompt: str = "w5", max_tokens: int = 2) -> httpx.Response:
    return httpx.post(f"{server.base_url}/completions", timeout=60, headers={"Authorization": f"Bearer {key}"},
                      json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})


def refilled(since_s: float, per_minute: int) -> int:
    """The most units a bucket can have refilled since `since_s` (the test's own clock)."""
    return math.floor((time.monotonic() - since_s) * per_minute / 60) + 1


def test_requests_per_minute_count_down_to_a_429_and_recover(quota_server: ServerProcess) -> None:
    start_s = time.monotonic()
    num_ok = 0
    for _ in range(RPM + 5):  # bounded: the bucket empties within RPM + what refills meanwhile
        response = complete(quota_server, "key-rpm")
        if response.status_code != 200:
            break
        num_ok += 1
        remaining = int(response.headers["x-ratelimit-remaining-requests"])
        assert RPM - num_ok <= remaining <= RPM - num_ok + refilled(start_s, RPM)
        assert response.headers["x-ratelimit-limit-requests"] == str(RPM)
        assert re.fullmatch(r"(\d+m)?[\d.]+m?s", response.headers["x-ratelimit-reset-requests"])
    assert RPM <= num_ok <= RPM + refilled(start_s, RPM)
    err = error_of(response, 429)
    assert (err["code"], err["type"]) == ("rate_limit_exceeded", "rate_limit_error") and "requests" in err["message"]
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert response.headers["x-ratelimit-limit-requests"] == str(RPM)
    retry_after_s = int(response.headers["retry-after"])
    assert 1 <= retry_after_s <= 60 / RPM
    record = quota_server.audit_for(response.headers["x-request-id"])
    assert (record["outcome"], record["reason"], record["http_status"]) == ("rejected",
                                                                          "requests_per_minute_exceeded", 429)
    assert complete(quota_server, "key-alice").status_code == 200  # other tenants are not limited by it
    time.sleep(retry_after_s)
    assert complete(quota_server, "key-rpm").status_code == 200


def test_tokens_per_minute_count_prompt_and_completion(quota_server: ServerProcess) -> None:
    start_s = time.monotonic()
    first = complete(quota_server, "key-tpm", max_tokens=12)
    assert first.status_code == 200, first.text
    used = first.json()["usage"]["total_tokens"]
    remaining = int(first.headers["x-ratelimit-remaining-tokens"])
    assert TPM - used <= remaining <= TPM - used + refilled(start_s, TPM)
    too_large = complete(quota_server, "key-tpm", prompt=" ".join(["w5"] * (TPM + 1)))
    err = error_of(too_large, 429)
    assert "Request too large" in err["message"] and "retry-after" not in too_large.headers
    big_prompt = " ".join(["w5"] * (TPM - 2))  # more than what is left after the first request
    refused = complete(quota_server, "key-tpm", prompt=big_prompt)
    err = error_of(refused, 429)
    assert "tokens" in err["message"] and int(refused.headers["retry-after"]) >= 1
    assert int(refused.headers["x-ratelimit-remaining-tokens"]) < TPM - 2
    record = quota_server.audit_for(refused.headers["x-request-id"])
    assert record["reason"] == "tokens_per_minute_exceeded" and record["prompt_tokens"] >= TPM - 2


def test_limits_follow_a_reload(quota_server: ServerProcess) -> None:
    try:
        write_keys(quota_server, QUOTA_KEYS | {"key-bob": {"tenant": "bob", "requests_per_minute": 1}})
        assert reload(quota_server).json()["tenants_changed"] == ["bob"]
        assert complete(quota_server, "key-bob").headers["x-ratelimit-limit-requests"] == "1"
        assert error_of(complete(quota_server, "key-bob"), 429)["code"] == "rate_limit_exceeded"
    finally:
        write_keys(quota_server, QUOTA_KEYS)
        assert reload(quota_server).status_code == 200
    assert "x-ratelimit-limit-requests" not in complete(quota_server, "key-bob").headers


def _tenant_counters(server: ServerProcess, tenant: str) -> dict[str, float]:
    text = server.metrics_text()
    out = {}
    for name in ("kvseal_prompt_tokens_total", "kvseal_completion_tokens_total", "kvseal_cached_tokens_total"):
        match = re.search(rf'^{name}{{tenant="{tenant}"}} (\S+)$', text, re.MULTILINE)
        out[name] = float(match.group(1)) if match else 0.0
    return out


def _vllm_series(server: ServerProcess) -> dict[tuple[str, str], float]:
    """vLLM's series by (sample name, finished_reason), every one labelled with the served model."""
    model = httpx.get(f"{server.base_url}/models", headers={"Authorization": "Bearer key-alice"},
                      timeout=10).json()["data"][0]["id"]
    out = {}
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                assert (sample.labels["model_name"], sample.labels["engine"]) == (model, "0"), sample
                out[(sample.name, sample.labels.get("finished_reason", ""))] = sample.value
    return out


def test_per_tenant_token_counters_equal_the_usage_fields(quota_server: ServerProcess) -> None:
    before = {t: _tenant_counters(quota_server, t) for t in ("alice", "bob")}
    vllm_before = _vllm_series(quota_server)
    usage: dict[str, list[dict[str, Any]]] = {"alice": [], "bob": []}
    bodies = [{"prompt": "w5 w6 w7 w8 w9 w10 w11 w12", "max_tokens": 3},
              {"prompt": "w5 w6 w7 w8 w9 w10 w11 w12", "max_tokens": 4},  # a prefix-cache hit of the first
              {"prompt": "w20", "max_tokens": 2, "n": 2}]
    for tenant in usage:
        for body in bodies:
            response = httpx.post(f"{quota_server.base_url}/completions", json=body | {"ignore_eos": True},
                                  headers={"Authorization": f"Bearer key-{tenant}"}, timeout=60)
            assert response.status_code == 200, response.text
            usage[tenant].append(response.json()["usage"])
    for tenant, usages in usage.items():
        after = _tenant_counters(quota_server, tenant)
        delta = {k: after[k] - before[tenant][k] for k in after}
        assert delta["kvseal_prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
        assert delta["kvseal_completion_tokens_total"] == sum(u["completion_tokens"] for u in usages)
        assert delta["kvseal_cached_tokens_total"] == sum(u["prompt_tokens_details"]["cached_tokens"]
                                                          for u in usages)
    assert sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage["alice"]) > 0  # the counter moved
    # vLLM's names, over every tenant: the same usage, one success per request (all ran to max_tokens)
    everyone = usage["alice"] + usage["bob"]
    vllm_after = _vllm_series(quota_server)
    vllm_delta = {key: vllm_after[key] - vllm_before.get(key, 0.0) for key in vllm_after}
    assert vllm_delta[("vllm:prompt_tokens_total", "")] == sum(u["prompt_tokens"] for u in everyone)
    assert vllm_delta[("vllm:generation_tokens_total", "")] == sum(u["completion_tokens"] for u in everyone)
    assert vllm_delta[("vllm:prefix_cache_hits_total", "")] == sum(u["prompt_tokens_details"]["cached_tokens"]
                                                                   for u in everyone)
    assert vllm_delta[("vllm:request_success_total", "length")] == len(everyone)
    assert vllm_delta[("vllm:request_success_total", "stop")] == 0
    assert vllm_delta[("vllm:e2e_request_latency_seconds_count", "")] == len(everyone)
    assert vllm_delta[("vllm:time_to_first_token_seconds_count", "")] == len(everyone)


def test_vllms_load_gauges_are_the_engines_load_as_kvseal_reports_it(quota_server: ServerProcess) -> None:
    """vLLM's load gauges read what kvseal's read, from the same engine report, in every scrape
    while a request runs and after it: the running count, and the pool's used fraction. (Whether a
    scrape catches the tiny model's request running is a race: its 400 tokens can all be decoded
    before the client reads the first; the values are shown in tests/server/test_metrics.py.)"""
    def both() -> tuple[tuple[float, float], tuple[float, float]]:
        series = _vllm_series(quota_server)
        text = quota_server.metrics_text()
        kvseal = {name: float(value) for name, value in re.findall(
            r"^(kvseal_num_requests_running|kvseal_kv_pages_used|kvseal_kv_pages_free) (\S+)$", text, re.MULTILINE)}
        used, free = kvseal["kvseal_kv_pages_used"], kvseal["kvseal_kv_pages_free"]
        return ((series[("vllm:num_requests_running", "")], series[("vllm:kv_cache_usage_perc", "")]),
                (kvseal["kvseal_num_requests_running"], used / (used + free)))

    body = {"prompt": "w5 w6 w7", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{quota_server.base_url}/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer key-alice"}) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # it is generating (or has generated)
        vllm, kvseal = both()
        assert vllm == kvseal and 0 <= vllm[1] <= 1, (vllm, kvseal)
    deadline_s = time.monotonic() + 30  # the stream was left: the engine aborts it and frees its pages
    while (seen := both())[0] != (0, 0) and time.monotonic() < deadline_s:
        time.sleep(0.1)
    assert seen == ((0, 0), (0, 0))


def test_rejections_are_counted_per_tenant_and_reason(quota_server: ServerProcess) -> None:
    def count() -> float:
        match = re.search(r'^kvseal_rejections_total\{reason="model_not_found",tenant="bob"\} (\S+)$',
                          quota_server.metrics_text(), re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    before = count()
    response = httpx.post(f"{quota_server.base_url}/completions", json={"prompt": "w5", "model": "nope"},
                          headers={"Authorization": "Bearer key-bob"}, timeout=60)
    assert error_of(response, 404)
    assert count() == before + 1


def test_refusals_of_a_limited_tenant_carry_its_headers_too(quota_server: ServerProcess) -> None:
    response = httpx.post(f"{quota_server.base_url}/completions", json={"prompt": "w5", "model": "nope"},
                          headers={"Authorization": "Bearer key-tpm"}, timeout=60)
    assert error_of(response, 404)["code"] == "model_not_found"
    assert response.headers["x-ratelimit-limit-tokens"] == str(TPM)
    assert "x-ratelimit-limit-requests" not in response.headers  # tenant tpm has no requests limit


def test_a_stream_carries_the_headers(quota_server: ServerProcess) -> None:
    with httpx.stream("POST", f"{quota_server.base_url}/completions", timeout=60,
                      json={"prompt": "w5", "max_tokens": 2, "stream": True},
                      headers={"Authorization": "Bearer key-stream"}) as response:
        assert response.status_code == 200
        assert response.headers["x-ratelimit-limit-requests"] == "100"
        assert response.headers["x-ratelimit-remaining-requests"] == "99"  # its first request
        assert list(response.iter_lines())[-2] == "data: [DONE]"
