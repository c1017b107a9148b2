"""The operator's actions on `kvseal serve --pd` (a frontend over a prefill and a decode engine):
the kill switch with and without abort, and a key revoked by a reload with abort, end their
requests in both engines with the right error and audit record; SIGHUP reloads the keys (tests/server/test_admin.py
covers the same frontend over a colocated engine in detail)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
from pd_servers import ENGINE_FLAGS, Proc
from processes import free_port, read_jsonl, wait_for

sys.path.insert(0, str(Path(__file__).parent.parent / "server"))
from tiny_server_model import make_server_model  # noqa: E402

KEYS = {"key-alice": {"tenant": "alice"}, "key-bob": {"tenant": "bob"}, "key-ops": {"tenant": "ops", "admin": True}}
FLAGS = [*ENGINE_FLAGS, "--kv-cache-tokens", "1024", "--max-model-len", "512"]
ADMIN = {"Authorization": "Bearer key-ops"}
STREAM = {"prompt": "w5 w6", "max_tokens": 500, "ignore_eos": True, "stream": True}


def _stream_then(url: str, key: str, action: Any) -> tuple[list[dict[str, Any]], str, Any]:
    with httpx.stream("POST", f"{url}/v1/completions", json=STREAM, headers={"Authorization": f"Bearer {key}"},
                      timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        next(lines)
        result = action()
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        return events, response.headers["x-request-id"], result


def _complete(url: str, key: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": "w5", "max_tokens": 2},
                      headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _record(audit: Path, request_id: str) -> dict[str, Any]:
    found = wait_for(lambda: [r for r in read_jsonl(audit) if r.get("request_id") == request_id], "the record")
    return dict(found[0])


def _serve_pd(tmp_path: Path) -> tuple[Proc, str, Path, Path, Path]:
    """`serve --pd` on a tiny model with the keys file KEYS and an audit log: the server (started,
    not yet healthy), its URL, the model, the keys file and the audit log."""
    model = make_server_model(tmp_path / "tiny")
    keys, audit = tmp_path / "keys.json", tmp_path / "audit.jsonl"
    keys.write_text(json.dumps(KEYS))
    port = free_port()
    argv = ["serve", "--pd", "--model", str(model), "--port", str(port), "--api-keys", str(keys),
            "--audit-log", str(audit), *FLAGS]
    return Proc("serve-pd", argv, tmp_path).start(), f"http://127.0.0.1:{port}", model, keys, audit


def test_kill_switch_and_revocation_in_pd_mode(tmp_path: Path) -> None:
    server, url, model, keys, audit = _serve_pd(tmp_path)
    switch = f"{url}/admin/models/{model.name}"
    try:
        server.wait_until_healthy(url)
        events, _, answer = _stream_then(url, "key-alice", lambda: httpx.post(f"{switch}/disable", headers=ADMIN))
        assert answer.json()["num_aborted"] == 0 and events[-1]["choices"][0]["finish_reason"] == "length"
        assert _complete(url, "key-bob").json()["error"]["code"] == "model_disabled"
        httpx.post(f"{switch}/enable", headers=ADMIN).raise_for_status()
        events, request_id, answer = _stream_then(
            url, "key-alice", lambda: httpx.post(f"{switch}/disable?abort=true", headers=ADMIN))
        assert answer.json()["num_aborted"] == 1 and events[-1]["error"]["code"] == "model_disabled"
        assert (_record(audit, request_id)["outcome"], _record(audit, request_id)["reason"]) == ("aborted",
                                                                                               "model_disabled")
        httpx.post(f"{switch}/enable", headers=ADMIN).raise_for_status()
        keys.write_text(json.dumps({k: v for k, v in KEYS.items() if k != "key-alice"}))
        events, request_id, answer = _stream_then(
            url, "key-alice", lambda: httpx.post(f"{url}/admin/keys/reload?abort=true", headers=ADMIN))
        assert answer.json()["num_aborted"] == 1 and events[-1]["error"]["code"] == "api_key_revoked"
        assert _record(audit, request_id)["reason"] == "api_key_revoked"
        assert _complete(url, "key-alice").status_code == 401
        assert _complete(url, "key-bob").status_code == 200
        keys.write_text(json.dumps(KEYS | {"key-carol": {"tenant": "carol"}}))
        assert server.proc is not None
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: _complete(url, "key-carol").status_code == 200, "the SIGHUP reload to add carol's key")
        assert _complete(url, "key-alice").status_code == 200
        server.assert_running()
    finally:
        assert server.terminate() == 0


def test_a_tenant_removed_and_added_again_starts_with_an_empty_cache_in_pd_mode(tmp_path: Path) -> None:
    """The reload that removes alice has both engines forget her name's cache (PdClient), so a key
    added under the name later gets no hit on her prompts; bob's cache is untouched."""
    server, url, _, keys, audit = _serve_pd(tmp_path)
    prompt = " ".join(f"w{i}" for i in range(100, 164))

    def cached(key: str) -> int:
        response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                              headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    def reload_with(table: dict[str, Any]) -> dict[str, Any]:
        keys.write_text(json.dumps(table))
        answer = httpx.post(f"{url}/admin/keys/reload", headers=ADMIN, timeout=30)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    try:
        server.wait_until_healthy(url)
        cached("key-alice"), cached("key-bob")
        assert cached("key-alice") > 0 and cached("key-bob") > 0
        without_alice = {k: v for k, v in KEYS.items() if k != "key-alice"}
        assert reload_with(without_alice)["tenants_forgotten"] == ["alice"]
        reload_with(without_alice | {"key-alice-2": {"tenant": "alice"}})
        assert cached("key-alice-2") == 0, "the new key of the name hit the removed tenant's cache"
        assert cached("key-bob") > 0
        record = [r for r in read_jsonl(audit) if r.get("tenants_forgotten")][-1]
        assert record["num_engines_told"] == 2  # the prefill and the decode engine
    finally:
        assert server.terminate() == 0
