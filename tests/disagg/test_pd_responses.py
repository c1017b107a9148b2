"""`POST /v1/responses` through a real PD deployment (both transports): the frontend serves it on
the same pipeline as chat, so a response is chat's answer, streamed or not, and its
`input_tokens_details.cached_tokens` is the tenant's own prefix only (I5)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from marker_model import marker_prompt
from pd_servers import PdCluster, assert_engines_clean


def _post(cluster: PdCluster, tenant: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{cluster.frontend.url}/v1/{path}", json={"model": cluster.frontend.model_name} | body,
                          headers={"authorization": f"Bearer key-{tenant}"}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def _streamed_text(cluster: PdCluster, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    text, last = "", {}
    with httpx.stream("POST", f"{cluster.frontend.url}/v1/responses", timeout=60,
                      json={"model": cluster.frontend.model_name, "stream": True} | body,
                      headers={"authorization": "Bearer key-alice"}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                text += event.get("delta", "") if event["type"] == "response.output_text.delta" else ""
                last = event
    return text, last


def test_pd_a_response_is_chats_answer_and_its_cache_the_tenants(pd_cluster: PdCluster) -> None:
    prompt = marker_prompt(493, 60)
    first = _post(pd_cluster, "alice", "responses", {"input": prompt, "max_output_tokens": 5, "temperature": 0})
    chat = _post(pd_cluster, "alice", "chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                                           "max_tokens": 5, "temperature": 0})
    [message] = first["output"]
    assert message["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert first["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert first["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # alice's own prefix, from the response
    text, last = _streamed_text(pd_cluster, {"input": prompt, "max_output_tokens": 5, "temperature": 0})
    assert text == message["content"][0]["text"] and last["type"] == "response.completed"
    assert last["response"]["usage"]["input_tokens_details"]["cached_tokens"] > 0
    other = _post(pd_cluster, "bob", "responses", {"input": prompt, "max_output_tokens": 5, "temperature": 0})
    assert other["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert other["output"][0]["content"][0]["text"] == text
    assert_engines_clean(pd_cluster.prefill, pd_cluster.decode)
