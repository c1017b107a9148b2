"""The audit log (I8): exactly one line per request, with the right outcome and no prompt text."""

from __future__ import annotations

from typing import Any

import httpx
from server_process import MAX_MODEL_LEN, ServerProcess

SECRET_PROMPT = "w333 w334 w335 w336"


def _send(server: ServerProcess, body: Any, key: str | None = "key-alice", path: str = "/completions") -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60)
    return response.headers["x-request-id"]


def _stream(server: ServerProcess, body: Any) -> str:
    with httpx.stream("POST", f"{server.base_url}/completions", json=body | {"stream": True}, timeout=60,
                      headers={"Authorization": "Bearer key-bob"}) as response:
        list(response.iter_lines())
        return response.headers["x-request-id"]


def test_one_record_per_request_with_its_outcome(server: ServerProcess) -> None:
    expected = {
        # ignore_eos: the random model's unseeded sampling may draw EOS, and these must run to length
        _send(server, {"prompt": SECRET_PROMPT, "max_tokens": 3, "ignore_eos": True}): ("finished", None, "alice"),
        _stream(server, {"prompt": SECRET_PROMPT, "max_tokens": 3, "ignore_eos": True}): ("finished", None, "bob"),
        _send(server, {"messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 2, "ignore_eos": True},
              path="/chat/completions"): ("finished", None, "alice"),
        _send(server, {"prompt": "w5 " * (MAX_MODEL_LEN + 1)}): ("rejected", "context_length_exceeded", "alice"),
        _send(server, {"prompt": SECRET_PROMPT, "temperature": -1}): ("rejected", "invalid_parameter", "alice"),
        _send(server, {"prompt": SECRET_PROMPT, "tools": []}): ("rejected", "unsupported_parameter", "alice"),
        _send(server, {"prompt": SECRET_PROMPT, "model": "other"}): ("rejected", "model_not_found", "alice"),
        _send(server, {"prompt": SECRET_PROMPT}, key="wrong"): ("rejected", "invalid_api_key", None),
        _send(server, {"prompt": SECRET_PROMPT}, key=None): ("rejected", "invalid_api_key", None),
    }
    for request_id, (outcome, reason, tenant) in expected.items():
        record = server.audit_for(request_id)
        assert (record["outcome"], record.get("reason"), record["tenant"]) == (outcome, reason, tenant), record
        assert record["finished_at"] >= record["received_at"]
        if outcome == "finished":
            assert record["output_tokens"] >= 2 and record["pages_reserved"] >= 1
            assert record["finish_reason"] == "length" and "first_token_at" in record
        else:
            assert record["http_status"] in (400, 401, 404)
    long_record = server.audit_for(next(iter(k for k, v in expected.items() if v[1] == "context_length_exceeded")))
    assert long_record["prompt_tokens"] == MAX_MODEL_LEN + 1
    finished = server.audit_for(next(iter(expected)))
    assert finished["prompt_tokens"] == 4 and finished["output_tokens"] == 3
    assert finished["pages_reserved"] == 2  # 4 prompt + 2 computed output tokens in pages of 4


def test_no_prompt_text_by_default(server: ServerProcess) -> None:
    _send(server, {"prompt": SECRET_PROMPT, "max_tokens": 2})
    text = server.audit_path.read_text()
    assert SECRET_PROMPT not in text and '"prompt"' not in text


def test_request_ids_are_unique(server: ServerProcess) -> None:
    sent = [_send(server, {"prompt": SECRET_PROMPT, "max_tokens": 1}) for _ in range(3)]
    sent += [_send(server, {"prompt": SECRET_PROMPT, "temperature": -1}),
             _stream(server, {"prompt": "w5", "max_tokens": 1})]
    assert len(set(sent)) == len(sent)
    for request_id in sent:
        server.audit_for(request_id)  # exactly one record each
    ids = [r["request_id"] for r in server.audit_records()]
    assert len(ids) == len(set(ids)) >= len(sent)
