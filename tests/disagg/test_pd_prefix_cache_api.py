"""Prefix caching through a real PD deployment (both transports): the same tenant's repeated
prefix is served from decode's cache and reported in `usage.prompt_tokens_details.cached_tokens`
and the per-tenant metrics; another tenant's identical prompt is not; both engines stay clean."""

from __future__ import annotations

import json
from typing import Any

import httpx
from marker_model import marker_prompt
from pd_servers import PdCluster, assert_engines_clean

PAGE = 4  # pd_servers.ENGINE_FLAGS


def complete(cluster: PdCluster, tenant: str, prompt: str, stream: bool = False, **extra: Any) -> dict[str, Any]:
    body = {"model": cluster.frontend.model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0} | extra
    headers = {"authorization": f"Bearer key-{tenant}"}
    url = f"{cluster.frontend.url}/v1/completions"
    if not stream:
        response = httpx.post(url, json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    text, usage = "", None
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += "".join(c["text"] for c in chunk["choices"])
                usage = chunk.get("usage") or usage
    return {"choices": [{"text": text}], "usage": usage}


def cached_tokens(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_pd_reports_the_same_tenants_hit_and_never_another_tenants(pd_cluster: PdCluster) -> None:
    prompt = marker_prompt(477, 60)
    hits_before = pd_cluster.frontend.metric("kvseal_prefix_cache_hits_total", tenant="alice")
    first = complete(pd_cluster, "alice", prompt)
    second = complete(pd_cluster, "alice", prompt)
    streamed = complete(pd_cluster, "alice", prompt, stream=True)
    other = complete(pd_cluster, "bob", prompt)
    num_prompt = first["usage"]["prompt_tokens"]
    assert cached_tokens(first) == 0 and cached_tokens(other) == 0
    assert cached_tokens(second) == cached_tokens(streamed) == (num_prompt - 1) // PAGE * PAGE > 0
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == streamed["choices"][0]["text"] \
        == other["choices"][0]["text"] == " w477" * 6
    assert pd_cluster.frontend.metric("kvseal_prefix_cache_hits_total", tenant="alice") - hits_before \
        == 2 * cached_tokens(second)
    assert_engines_clean(pd_cluster.prefill, pd_cluster.decode)


def test_pd_a_cache_salt_splits_the_tenants_cache_on_decode(pd_cluster: PdCluster) -> None:
    """Decode derives a reservation's namespace from its tenant and salt, as a colocated engine does."""
    prompt = marker_prompt(481, 60)
    assert cached_tokens(complete(pd_cluster, "alice", prompt, cache_salt="user-1")) == 0
    assert cached_tokens(complete(pd_cluster, "alice", prompt, cache_salt="user-1")) > 0
    assert cached_tokens(complete(pd_cluster, "alice", prompt, cache_salt="user-2")) == 0
    assert cached_tokens(complete(pd_cluster, "alice", prompt)) == 0
    assert cached_tokens(complete(pd_cluster, "bob", prompt, cache_salt="user-1")) == 0
    assert_engines_clean(pd_cluster.prefill, pd_cluster.decode)


def test_pd_echo_with_logprobs_scores_the_whole_prompt(pd_cluster: PdCluster) -> None:
    """Echo with logprobs and max_tokens 0 through PD: prefill computes every prompt position's
    logprob (reading none of its cache, even with the prompt cached) and they reach the client
    through decode's first output; the same prompt scores the same twice."""
    prompt = marker_prompt(481, 40)
    complete(pd_cluster, "alice", prompt)  # caches the prompt's pages on both engines
    body = {"model": pd_cluster.frontend.model_name, "prompt": prompt, "max_tokens": 0, "echo": True,
            "logprobs": 1, "temperature": 0}
    scored = []
    for _ in range(2):
        response = httpx.post(f"{pd_cluster.frontend.url}/v1/completions", json=body,
                              headers={"authorization": "Bearer key-alice"}, timeout=60)
        assert response.status_code == 200, response.text
        scored.append(response.json())
    choice = scored[0]["choices"][0]
    logprobs = choice["logprobs"]["token_logprobs"]
    assert choice["text"] == prompt and len(logprobs) == scored[0]["usage"]["prompt_tokens"]
    assert cached_tokens(scored[0]) == 0 and cached_tokens(scored[1]) == 0
    assert logprobs[0] is None and all(isinstance(v, float) and v <= 0 for v in logprobs[1:])
    assert scored[1]["choices"][0]["logprobs"] == choice["logprobs"]
    assert_engines_clean(pd_cluster.prefill, pd_cluster.decode)
