"""The request body, in-process (no engine process): a big body is parsed off the event loop, so
/health and another tenant's request are answered while it is; a body holding too many JSON
containers or members is refused before it is parsed; and every request counts against its
tenant's requests per minute, a refused body too."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tiny_models import make_tokenizer

from kvseal.config import EngineArgs
from kvseal.engine.client import EngineClient
from kvseal.messages.msgs import EngineReadyMsg
from kvseal.server.app import build_app
from kvseal.server.audit import AuditLog
from kvseal.server.auth import ApiKeyTable
from kvseal.server.body import INLINE_PARSE_BYTES
from kvseal.server.body_shape import MAX_BODY_CONTAINERS, MAX_BODY_MEMBERS, BodyShape, body_shape, check_body_shape
from kvseal.server.config import ServerConfig
from kvseal.server.errors import ApiError
from kvseal.server.metrics import ServerMetrics
from kvseal.server.prompts import PromptEncoder
from kvseal.server.responses_body import ResponsesBody
from kvseal.server.state import AppState

READY = EngineReadyMsg(pid=1, model_name="tiny", model_path="/m", tokenizer_path="/m", architecture="llama",
                       max_model_len=64, kv_cache_tokens=256, vocab_size=512, page_size=4, num_pages=64,
                       kv_scrub_policy="off")
KEYS = {"key-a": {"tenant": "alice"}, "key-b": {"tenant": "bob"}, "key-r": {"tenant": "rita", "requests_per_minute": 1}}
WAIT_S = 10  # bounds every wait: a test that would hang fails instead


async def _ready_state(tmp_path: Path) -> AppState:
    """An AppState around an EngineClient whose engine has 'said ready' (no process started)."""
    keys_path = tmp_path / "keys.json"
    keys_path.write_text(json.dumps(KEYS))
    engine = EngineClient(EngineArgs(), "INFO")
    engine._ready = asyncio.get_running_loop().create_future()
    engine._ready.set_result(READY)
    return AppState(ServerConfig(), engine, READY, PromptEncoder(make_tokenizer()), ApiKeyTable.load(str(keys_path)),
                    ServerMetrics(), AuditLog(str(tmp_path / "audit.jsonl"), include_prompts=False))


def _close(state: AppState) -> None:
    state.engine._push.close(linger=0)
    state.engine._pull.close(linger=0)
    state.engine._process.cleanup()
    state.prompts.close()
    state.bodies.close()
    state.audit.close()


def _audit(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]


def _parts(num_items: int, num_parts: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "input_text", "text": ""}] * num_parts}] * num_items


class _HeldParse:
    """Holds every Responses body parse until `release` (at most `WAIT_S`), noting whether it
    was released or gave up waiting: what the test waits for and what it checks, not a clock."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.gave_up = False
        self._parse = ResponsesBody.model_validate_json

    def __call__(self, json_data: Any, **kwargs: Any) -> ResponsesBody:
        self.entered.set()
        self.gave_up = not self.release.wait(WAIT_S)
        return self._parse(json_data, **kwargs)


@pytest.fixture
def held_parse(monkeypatch: pytest.MonkeyPatch) -> Iterator[_HeldParse]:
    held = _HeldParse()
    monkeypatch.setattr(ResponsesBody, "model_validate_json", held)
    yield held
    held.release.set()


def test_health_and_another_tenant_are_answered_while_a_big_body_is_parsed(tmp_path: Path,
                                                                           held_parse: _HeldParse) -> None:
    """alice's 1 MB body (a thousand content parts in each of 31 items, and a field kvseal
    does not take) is held in its parse; meanwhile /health and bob's small request are
    answered, and only then is alice's parse let go and her body refused. On the event loop
    the held parse held everything: /health came only after it gave up waiting."""
    body = {"input": _parts(31, 1000), "zzz": 1}
    data = json.dumps(body).encode()
    assert len(data) >= INLINE_PARSE_BYTES

    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response, bool]:
        state = await _ready_state(tmp_path)
        try:
            transport = httpx.ASGITransport(app=build_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=WAIT_S) as client:
                big = asyncio.create_task(client.post("/v1/responses", content=data, headers={
                    "Authorization": "Bearer key-a", "content-type": "application/json"}))
                assert await asyncio.to_thread(held_parse.entered.wait, WAIT_S)
                health = await client.get("/health")
                small = await client.post("/v1/chat/completions", headers={"Authorization": "Bearer key-b"},
                                          json={"messages": [{"role": "user", "content": "hi"}], "zzz": 1})
                was_held = not held_parse.release.is_set() and not held_parse.gave_up
                held_parse.release.set()
                return health, small, await asyncio.wait_for(big, WAIT_S), was_held
        finally:
            _close(state)

    health, small, big, was_held = asyncio.run(scenario())
    assert health.status_code == 200 and small.status_code == 400, small.text
    assert was_held, "/health and bob's request were answered only after alice's parse stopped holding"
    assert big.status_code == 400 and big.json()["error"]["param"] == "zzz", big.text


def test_a_refused_body_counts_against_the_tenants_requests_per_minute(tmp_path: Path) -> None:
    """rita may send one request a minute. Her first is refused for its body (400); it counted
    as it arrived, so her second is refused 429 before its body is read, audited as such, as
    OpenAI counts requests (refused ones too)."""
    async def scenario() -> list[httpx.Response]:
        state = await _ready_state(tmp_path)
        try:
            transport = httpx.ASGITransport(app=build_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=WAIT_S) as client:
                return [await client.post("/v1/responses", headers={"Authorization": "Bearer key-r"},
                                          json={"input": "hi", "zzz": 1}) for _ in range(2)]
        finally:
            _close(state)

    first, second = asyncio.run(scenario())
    assert first.status_code == 400 and first.json()["error"]["param"] == "zzz", first.text
    assert first.headers["x-ratelimit-remaining-requests"] == "0"
    assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limit_exceeded", second.text
    records = _audit(tmp_path)
    assert [(r["tenant"], r["http_status"], r["reason"]) for r in records] == [
        ("rita", 400, "unsupported_parameter"), ("rita", 429, "requests_per_minute_exceeded")]


def _refusal(data: bytes) -> str:
    with pytest.raises(ApiError) as refused:
        check_body_shape(data)
    assert (refused.value.status, refused.value.code) == (400, "body_too_complex")
    return refused.value.message


def test_the_reviewers_body_is_refused_for_its_containers_before_it_is_parsed() -> None:
    """440 items of 1,024 empty parts (15 MB): ~2.3 s to validate; refused from its bytes."""
    data = json.dumps({"input": _parts(440, 1024)}).encode()
    assert _refusal(data) == (
        f"The request body holds {1 + 1 + 440 * 2 + 440 * 1024} JSON objects and arrays; a request may hold at most "
        f"{MAX_BODY_CONTAINERS}. Send a smaller one (a long conversation: join adjacent text parts into one, or "
        f"split it across requests).")


@pytest.mark.parametrize(("value", "what"), [
    ([[]] * (MAX_BODY_CONTAINERS - 2), None),  # with the body's object and the outer array: at the limit
    ([[]] * (MAX_BODY_CONTAINERS - 1), "JSON objects and arrays"),
    ({str(i): 0 for i in range(MAX_BODY_MEMBERS - 1)}, None),  # and the body's own "zzz" member
    ({str(i): 0 for i in range(MAX_BODY_MEMBERS)}, "object members"),
])
def test_containers_and_members_are_bounded_at_their_limit(value: Any, what: str | None) -> None:
    data = json.dumps({"zzz": value}).encode()
    if what is None:
        check_body_shape(data)
    else:
        assert what in _refusal(data)


def test_a_body_nested_past_the_limit_is_invalid_json() -> None:
    """The parser's answer, not a count of its arrays: the body is no JSON kvseal reads."""
    with pytest.raises(ApiError) as refused:
        check_body_shape(b"[" * (MAX_BODY_CONTAINERS + 1) + b"]" * (MAX_BODY_CONTAINERS + 1))
    assert refused.value.code == "invalid_json" and f"nested {MAX_BODY_CONTAINERS + 1} deep" in refused.value.message


def test_brackets_and_colons_inside_strings_are_not_counted() -> None:
    """Escaped quotes and backslashes do not end a string; what a string holds is text."""
    text = '{[:\\"{[:\\\\'  # in JSON: {[:\"{[:\\ (a quote and a backslash, escaped)
    data = json.dumps({"a": text * 100_000, "b": [{"c": "\\\\"}]}).encode()
    assert body_shape(data) == BodyShape(num_containers=3, num_members=3, max_depth=3)
    check_body_shape(data)  # far more brackets and colons than the limits, all inside strings
