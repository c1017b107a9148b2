"""What adversarial testing found at the front door, each pinned by a regression test:
content type (415), admin-only /metrics, bounded log strings, prompts refused before they are
tokenized or parsed, max_tokens defaulting to the rest of the context, and the front-door
admission (I1) being the check that refuses an over-long prompt, not the engine's re-check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import KEYS, MAX_MODEL_LEN, ServerProcess
from test_http_errors import ALICE, error_of, post, words


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_a_body_that_is_not_declared_json_is_415(server: ServerProcess, content_type: str | None) -> None:
    headers = ALICE | ({"content-type": content_type} if content_type else {})
    response = post(server, "/completions", content=json.dumps({"prompt": "w5", "max_tokens": 1}).encode(),
                    headers=headers)
    assert error_of(response, 415)["code"] == "unsupported_media_type"
    charset = post(server, "/completions", content=b'{"prompt": "w5", "max_tokens": 1}',
                   headers=ALICE | {"content-type": "Application/JSON; charset=utf-8"})
    assert charset.status_code == 200, charset.text


def test_metrics_need_an_admin_key(server: ServerProcess) -> None:
    url = f"{server.url}/metrics"
    assert error_of(httpx.get(url, timeout=10), 401)["code"] == "invalid_api_key"
    assert error_of(httpx.get(url, headers={"Authorization": "Bearer nope"}, timeout=10), 401)
    assert error_of(httpx.get(url, headers=ALICE, timeout=10), 403)["code"] == "admin_key_required"
    assert "kvseal_engine_up 1.0" in server.metrics_text()  # with the admin key of KEYS
    assert any(entry.get("admin") for entry in KEYS.values())


def test_client_strings_are_bounded_in_the_audit_log(server: ServerProcess) -> None:
    huge = "m" * 100_000
    response = post(server, "/completions", {"prompt": "w5", "model": huge, "user": "u" * 256})
    err = error_of(response, 400)
    assert (err["code"], err["param"]) == ("invalid_parameter", "model")  # the field's bound
    assert len(err["message"]) < 1_000
    record = server.audit_for(response.headers["x-request-id"])
    assert "model" not in record and len(server.audit_path.read_text().splitlines()[-1]) < 5_000
    longest = post(server, "/completions", {"prompt": "w5", "model": "m" * 256, "user": "u" * 256})
    assert error_of(longest, 404)["code"] == "model_not_found"
    record = server.audit_for(longest.headers["x-request-id"])
    assert (record["model"], record["user"]) == ("m" * 256, "u" * 256)


def test_a_null_max_tokens_is_the_rest_of_the_context(server: ServerProcess) -> None:
    """Completions' max_tokens sent as null (left out, it is 16: test_http_errors.py)."""
    prompt = words(MAX_MODEL_LEN - 6)
    body = post(server, "/completions", {"prompt": prompt, "ignore_eos": True, "max_tokens": None}).json()
    usage = body["usage"]
    assert usage["prompt_tokens"] >= MAX_MODEL_LEN - 6
    assert usage["completion_tokens"] == MAX_MODEL_LEN - usage["prompt_tokens"]
    assert body["choices"][0]["finish_reason"] == "length"
    capped = post(server, "/completions", {"prompt": "w5", "ignore_eos": True, "max_tokens": None},
                  headers={"Authorization": "Bearer key-capped"}).json()
    assert capped["usage"]["completion_tokens"] == KEYS["key-capped"]["max_tokens"]


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_an_over_long_prompt_with_min_tokens_is_a_context_error(server: ServerProcess, path: str) -> None:
    prompt: dict[str, Any] = ({"prompt": words(MAX_MODEL_LEN + 3)} if path == "/completions" else
                              {"messages": [{"role": "user", "content": words(MAX_MODEL_LEN + 3)}]})
    err = error_of(post(server, path, prompt | {"min_tokens": 20}), 400)
    assert err["code"] == "context_length_exceeded"


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(server: ServerProcess) -> None:
    response = post(server, "/completions", {"prompt": "w5 " * 20_000})
    err = error_of(response, 400)
    assert err["code"] == "context_length_exceeded" and "40000 characters besides spaces" in err["message"]
    chat = post(server, "/chat/completions", {"messages": [{"role": "user", "content": "w5 " * 20_000}]})
    assert "characters" in error_of(chat, 400)["message"]
    truncated = post(server, "/completions", {"prompt": "w5 " * 20_000, "max_tokens": 1,
                                              "truncate_prompt_tokens": 8})
    assert truncated.status_code == 200 and truncated.json()["usage"]["prompt_tokens"] == 8


def test_a_long_token_id_list_is_refused_before_parsing(server: ServerProcess) -> None:
    ids = [5] * 50_000  # a body over the pre-scan size
    err = error_of(post(server, "/completions", {"prompt": ids}), 400)
    assert err["code"] == "context_length_exceeded" and "50000" in err["message"]
    err = error_of(post(server, "/completions", {"prompt": [5] * (MAX_MODEL_LEN + 1)}), 400)  # small body
    assert err["code"] == "context_length_exceeded"
    truncated = post(server, "/completions", {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 4})
    assert truncated.status_code == 200 and truncated.json()["usage"]["prompt_tokens"] == 4


def assert_refused_at_the_front_door(server: ServerProcess) -> None:
    """An over-long prompt is refused by the frontend's admission: the engine never sees it."""
    response = post(server, "/completions", {"prompt": [7] * (MAX_MODEL_LEN + 1), "max_tokens": 1})
    assert error_of(response, 400)["code"] == "context_length_exceeded"
    record = server.audit_for(response.headers["x-request-id"])
    assert record["rejected_by"] == "frontend", record
    assert "engine re-check rejected" not in server.log()


def test_the_front_door_admission_refuses_over_long_prompts(server: ServerProcess) -> None:
    assert_refused_at_the_front_door(server)


def test_the_front_door_test_fails_when_the_front_door_is_switched_off(server_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    """The guard of the guard: with the frontend's admission switched off, the engine's re-check
    refuses the prompt instead, and the test above notices."""
    unguarded = ServerProcess(server_model_dir, tmp_path, keys=KEYS, faults=["skip_front_door_admission"]).start()
    try:
        with pytest.raises(AssertionError, match="engine"):
            assert_refused_at_the_front_door(unguarded)
        records = unguarded.audit_records()
        assert records[-1]["rejected_by"] == "engine" and records[-1]["reason"] == "context_length_exceeded"
    finally:
        assert unguarded.terminate() == 0
