"""Operating a running server: the keys file reloaded live (HTTP and SIGHUP), hashed keys,
revocation with and without aborting in-flight requests, and the model's kill switch.

One server of its own (its keys file is rewritten by the tests; each test puts the original
back), plus one with the `KEEP_REVOKED_KEYS` fault to show the revocation test notices a
reload that keeps removed keys.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from processes import wait_for
from server_process import KEYS, ServerProcess
from test_http_errors import error_of

ADMIN = {"Authorization": "Bearer key-ops"}
STREAM = {"prompt": "w5 w6", "max_tokens": 500, "ignore_eos": True, "stream": True}


def _start(model_dir: Path, workdir: Path, faults: list[str] | None = None) -> ServerProcess:
    return ServerProcess(model_dir, workdir, keys=KEYS, faults=faults).start()


@pytest.fixture(scope="module")
def admin_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = _start(server_model_dir, tmp_path_factory.mktemp("admin-server"))
    yield proc
    proc.terminate()


@pytest.fixture
def srv(admin_server: ServerProcess) -> Iterator[ServerProcess]:
    """The admin server; its keys and model state are put back after the test."""
    yield admin_server
    write_keys(admin_server, KEYS)
    assert reload(admin_server).status_code == 200
    assert admin(admin_server, f"/admin/models/{admin_server.model_name}/enable").status_code == 200


def write_keys(server: ServerProcess, keys: Any) -> None:
    path = server.audit_path.parent / "keys.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(keys if isinstance(keys, str) else json.dumps(keys))
    tmp.replace(path)  # as an operator's editor or config tool would: never a half-written file


def admin(server: ServerProcess, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers=ADMIN if headers is None else headers, timeout=30)


def reload(server: ServerProcess, query: str = "") -> httpx.Response:
    return admin(server, f"/admin/keys/reload{query}")


def complete(server: ServerProcess, key: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}/completions", json={"prompt": "w5", "max_tokens": 2},
                      headers={"Authorization": f"Bearer {key}"}, timeout=60)


def admin_records(server: ServerProcess) -> list[dict[str, Any]]:
    return [r for r in server.audit_records() if "admin_action" in r]


def key_id(key: str) -> str:
    """As the audit log names a key (`printf %s KEY | sha256sum | cut -c1-12`)."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _stream_then(server: ServerProcess, key: str, action: Any) -> tuple[list[str], str, Any]:
    """Start a long stream with `key`, run `action()` once its first chunk is out, read the rest."""
    url = f"{server.base_url}/completions"
    with httpx.stream("POST", url, json=STREAM, headers={"Authorization": f"Bearer {key}"}, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        next(lines)
        result = action()
        rest = list(lines)
        return rest, response.headers["x-request-id"], result


def _events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def check_revocation_without_abort(server: ServerProcess) -> None:
    """A reload that drops alice's key: her next request is 401, her stream in flight finishes,
    bob is untouched, and a key added in the same reload works at once."""
    keys = {k: v for k, v in KEYS.items() if k != "key-alice"} | {"key-carol": {"tenant": "carol"}}
    write_keys(server, keys)
    rest, request_id, answer = _stream_then(server, "key-alice", lambda: reload(server))
    assert answer.status_code == 200, answer.text
    assert error_of(complete(server, "key-alice"), 401)["code"] == "invalid_api_key"
    summary = answer.json()
    assert summary["keys_removed"] == [key_id("key-alice")]
    assert summary["keys_added"] == [key_id("key-carol")]
    assert summary["num_aborted"] == 0
    assert complete(server, "key-carol").status_code == 200
    assert complete(server, "key-bob").status_code == 200
    assert _events(rest)[-1]["choices"][0]["finish_reason"] == "length"  # in flight: it finished
    assert server.audit_for(request_id)["outcome"] == "finished"


def test_a_reload_adds_and_revokes_keys_at_once(srv: ServerProcess) -> None:
    check_revocation_without_abort(srv)
    record = admin_records(srv)[-1]
    assert record["admin_action"] == "keys_reloaded" and record["trigger"] == "http"
    assert (record["by_tenant"], record["by_key_id"]) == ("ops", key_id("key-ops"))
    assert record["keys_removed"] == [key_id("key-alice")] and record["tenants_changed"] == ["alice", "carol"]
    assert "key-alice" not in srv.audit_path.read_text() and "key-alice" not in srv.log()


def _tenants_in_metrics(server: ServerProcess) -> set[str]:
    text = httpx.get(f"{server.url}/metrics", headers=ADMIN, timeout=30).text
    return set(re.findall(r'tenant="([^"]*)"', text))


def test_a_removed_tenant_leaves_no_series_in_metrics(srv: ServerProcess) -> None:
    for i in range(3):  # tenants that come and go: their series must not pile up
        write_keys(srv, KEYS | {f"key-passing-{i}": {"tenant": f"passing-{i}"}})
        assert reload(srv).status_code == 200
        assert complete(srv, f"key-passing-{i}").status_code == 200
    assert "passing-2" in _tenants_in_metrics(srv)
    write_keys(srv, KEYS)
    assert reload(srv).status_code == 200
    tenants = _tenants_in_metrics(srv)
    assert not {t for t in tenants if t.startswith("passing-")}, tenants
    assert complete(srv, "key-bob").status_code == 200
    assert "bob" in _tenants_in_metrics(srv)


def test_a_reload_with_abort_ends_the_revoked_keys_requests(srv: ServerProcess) -> None:
    write_keys(srv, {k: v for k, v in KEYS.items() if k != "key-alice"})
    rest, request_id, answer = _stream_then(srv, "key-alice", lambda: reload(srv, "?abort=true"))
    assert answer.json()["num_aborted"] == 1
    events = _events(rest)
    assert events[-1]["error"]["code"] == "api_key_revoked"
    assert not any(e.get("choices", [{}])[0].get("finish_reason") for e in events[:-1])
    record = srv.audit_for(request_id)
    assert (record["outcome"], record["reason"], record["tenant"]) == ("aborted", "api_key_revoked", "alice")
    assert admin_records(srv)[-1]["num_aborted"] == 1


def test_a_key_moved_to_another_tenant_is_reported_and_aborted_like_a_revoked_one(srv: ServerProcess) -> None:
    """A reload that gives alice's key to bob: the answer and the audit line name the move (by
    digest alone the key looked unchanged), and with `?abort=true` alice's stream on that key
    ends as a revoked key's would, instead of running on as alice for a key that is now bob's."""
    write_keys(srv, KEYS | {"key-alice": {"tenant": "bob"}})
    rest, request_id, answer = _stream_then(srv, "key-alice", lambda: reload(srv, "?abort=true"))
    summary = answer.json()
    moved = [{"key_id": key_id("key-alice"), "from_tenant": "alice", "to_tenant": "bob"}]
    assert (summary["keys_moved"], summary["keys_added"], summary["keys_removed"]) == (moved, [], []), summary
    assert summary["num_aborted"] == 1
    assert _events(rest)[-1]["error"]["code"] == "api_key_revoked"
    record = srv.audit_for(request_id)
    assert (record["outcome"], record["reason"], record["tenant"]) == ("aborted", "api_key_revoked", "alice")
    admin_record = admin_records(srv)[-1]
    assert admin_record["keys_moved"] == moved and admin_record["num_aborted"] == 1
    response = complete(srv, "key-alice")
    assert srv.audit_for(response.headers["x-request-id"])["tenant"] == "bob"  # it speaks for bob now


def test_abort_ends_only_the_revoked_keys_requests(srv: ServerProcess) -> None:
    write_keys(srv, {k: v for k, v in KEYS.items() if k != "key-alice"})
    rest, request_id, answer = _stream_then(srv, "key-bob", lambda: reload(srv, "?abort=true"))
    assert answer.json()["num_aborted"] == 0
    assert _events(rest)[-1]["choices"][0]["finish_reason"] == "length"


def test_a_malformed_keys_file_is_refused_whole_and_the_old_table_stays(srv: ServerProcess) -> None:
    for content, reason in (("{not json", "cannot read"), ({"key-x": {"tenant": "x", "max_tokens": 0}}, "max_tokens"),
                            ({"key-x": {"tenant": "x", "requests_per_minute": "many"}}, "requests_per_minute"),
                            ({"key-x": {"tenant": "x", "tokens_per_minute": 10**400}}, "tokens_per_minute"),
                            # longer than forget-cache takes: a name it could not forget after a restart
                            ({"key-x": {"tenant": "x" * 257}}, "257 characters")):
        write_keys(srv, content)
        err = error_of(reload(srv), 400)
        assert err["code"] == "invalid_keys_file" and reason in err["message"]
        assert complete(srv, "key-alice").status_code == 200  # the old table
        assert error_of(complete(srv, "key-x"), 401)
        record = admin_records(srv)[-1]
        assert record["admin_action"] == "keys_reload_refused" and reason in record["reason"]


def test_sighup_reloads_the_keys(srv: ServerProcess) -> None:
    write_keys(srv, KEYS | {"key-dave": {"tenant": "dave"}})
    assert error_of(complete(srv, "key-dave"), 401)
    assert srv.proc is not None
    num_records = len(admin_records(srv))
    srv.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: len(admin_records(srv)) > num_records, "the SIGHUP reload's audit record")
    assert complete(srv, "key-dave").status_code == 200
    record = admin_records(srv)[-1]
    assert (record["admin_action"], record["trigger"]) == ("keys_reloaded", "sighup") and "by_tenant" not in record
    srv.assert_running()


def test_hashed_keys_authenticate_and_malformed_hashes_are_refused(srv: ServerProcess) -> None:
    digest = hashlib.sha256(b"key-hashed-erin").hexdigest()
    write_keys(srv, KEYS | {f"sha256:{digest}": {"tenant": "erin"}})
    assert reload(srv).status_code == 200
    assert complete(srv, "key-hashed-erin").status_code == 200
    assert error_of(complete(srv, f"sha256:{digest}"), 401)  # the digest is not the key
    write_keys(srv, KEYS | {"sha256:ABC": {"tenant": "erin"}})
    assert "sha256" in error_of(reload(srv), 400)["message"]


def test_admin_routes_need_an_admin_key(srv: ServerProcess) -> None:
    paths = ["/admin/keys/reload", f"/admin/models/{srv.model_name}/disable", f"/admin/models/{srv.model_name}/enable"]
    for path in paths:
        assert error_of(admin(srv, path, {}), 401)["code"] == "invalid_api_key"
        assert error_of(admin(srv, path, {"Authorization": "Bearer nope"}), 401)["code"] == "invalid_api_key"
        err = error_of(admin(srv, path, {"Authorization": "Bearer key-alice"}), 403)
        assert (err["code"], err["type"]) == ("admin_key_required", "permission_error")
    assert complete(srv, "key-alice").status_code == 200  # nothing was disabled
    assert error_of(reload(srv, "?abort=maybe"), 400)["param"] == "abort"
    # given twice, which one counts would be a guess (one operator's abort is another's no-op)
    assert "given 2 times" in error_of(reload(srv, "?abort=true&abort=false"), 400)["message"]
    assert error_of(admin(srv, "/admin/models/other/disable"), 404)["code"] == "model_not_found"


def test_admin_routes_refuse_a_body_and_unknown_parameters_instead_of_ignoring_them(srv: ServerProcess) -> None:
    """`{"abort": true}` as a body once answered 200 with nothing aborted: the revoked key's
    request ran on. Options are query parameters; a body, or a parameter the route does not take
    (a typo of abort), is refused, and nothing changes."""
    name, num_records = srv.model_name, len(admin_records(srv))
    for path in ("/admin/keys/reload", f"/admin/models/{name}/disable", "/admin/tenants/alice/forget-cache"):
        response = httpx.post(f"{srv.url}{path}", json={"abort": True}, headers=ADMIN, timeout=30)
        assert error_of(response, 400)["code"] == "invalid_request_body"
        chunked = httpx.post(f"{srv.url}{path}", content=iter([b"x" * 1024] * 4), headers=ADMIN, timeout=30)
        assert error_of(chunked, 400)["code"] == "invalid_request_body"
        assert "'abrot'" in error_of(admin(srv, f"{path}?abrot=true"), 400)["message"]
    assert "takes no query parameters" in error_of(admin(srv, "/admin/tenants/alice/forget-cache?abort=true"),
                                                   400)["message"]
    assert complete(srv, "key-alice").status_code == 200  # nothing was disabled
    assert len(admin_records(srv)) == num_records  # no action was taken


def test_a_name_as_long_as_the_keys_file_allows_can_be_forgotten(srv: ServerProcess) -> None:
    """The keys file and forget-cache take the same names: 256 characters is the bound of both."""
    name = "customer-" + "Z" * 247
    write_keys(srv, KEYS | {"key-long": {"tenant": name}})
    assert reload(srv).status_code == 200
    prompt = " ".join(f"w{i}" for i in range(200, 264))
    _cached_tokens(srv, "key-long", prompt)
    assert _cached_tokens(srv, "key-long", prompt) > 0
    answer = admin(srv, f"/admin/tenants/{name}/forget-cache")
    assert answer.status_code == 200 and answer.json()["tenant"] == name
    assert _cached_tokens(srv, "key-long", prompt) == 0


def _model_card(server: ServerProcess, key: str) -> dict[str, Any]:
    response = httpx.get(f"{server.base_url}/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    return dict(response.json()["data"][0])


def test_the_kill_switch_refuses_new_requests_and_lets_in_flight_ones_finish(srv: ServerProcess) -> None:
    path = f"/admin/models/{srv.model_name}/disable"
    rest, request_id, answer = _stream_then(srv, "key-alice", lambda: admin(srv, path))
    assert answer.json() == {"id": srv.model_name, "object": "model", "disabled": True, "num_aborted": 0}
    err = error_of(complete(srv, "key-bob"), 503)
    assert err["code"] == "model_disabled" and srv.model_name in err["message"]
    assert _events(rest)[-1]["choices"][0]["finish_reason"] == "length"
    assert _model_card(srv, "key-ops")["disabled"] is True
    assert "disabled" not in _model_card(srv, "key-alice")  # the state is the operator's
    assert srv.metric(f'kvseal_model_enabled{{model="{srv.model_name}"}}') == 0
    assert admin(srv, f"/admin/models/{srv.model_name}/enable").json()["disabled"] is False
    assert complete(srv, "key-bob").status_code == 200
    assert srv.metric(f'kvseal_model_enabled{{model="{srv.model_name}"}}') == 1
    actions = [r["admin_action"] for r in admin_records(srv)[-2:]]
    assert actions == ["model_disabled", "model_enabled"]


def test_the_kill_switch_with_abort_ends_in_flight_requests(srv: ServerProcess) -> None:
    path = f"/admin/models/{srv.model_name}/disable?abort=true"
    rest, request_id, answer = _stream_then(srv, "key-alice", lambda: admin(srv, path))
    assert answer.json()["num_aborted"] == 1
    assert _events(rest)[-1]["error"]["code"] == "model_disabled"
    record = srv.audit_for(request_id)
    assert (record["outcome"], record["reason"]) == ("aborted", "model_disabled")
    assert admin_records(srv)[-1]["num_aborted"] == 1
    err = error_of(admin(srv, f"/admin/models/{srv.model_name}/enable?abort=true"), 400)
    assert err["param"] == "abort" and "applies only to disable" in err["message"], err
    assert "must be true or false" not in err["message"], err


def test_the_revocation_test_fails_when_a_reload_keeps_removed_keys(server_model_dir: Path, tmp_path: Path) -> None:
    faulty = _start(server_model_dir, tmp_path / "faulty", faults=["keep_revoked_keys"])
    try:
        with pytest.raises(AssertionError):
            check_revocation_without_abort(faulty)
        assert complete(faulty, "key-alice").status_code == 200  # what it caught: the removed key still works
    finally:
        faulty.terminate()


def test_without_a_keys_file_there_is_nothing_to_reload_and_the_switch_is_open(server_model_dir: Path,
                                                                                tmp_path: Path) -> None:
    open_server = ServerProcess(server_model_dir, tmp_path / "open").start()  # loopback, no --api-keys
    try:
        assert error_of(reload(open_server), 400)["code"] == "no_keys_file"
        assert admin(open_server, f"/admin/models/{open_server.model_name}/disable", {}).json()["disabled"] is True
        assert _model_card(open_server, "anything")["disabled"] is True  # everyone is the operator here
        assert error_of(complete(open_server, "anything"), 503)["code"] == "model_disabled"
        assert admin(open_server, f"/admin/models/{open_server.model_name}/enable", {}).status_code == 200
        # a web page cannot post to the open routes: a browser sends these without a preflight
        for headers in ({"Origin": "http://evil.example", "Content-Type": "text/plain"},
                        {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"}):
            refused = admin(open_server, f"/admin/models/{open_server.model_name}/disable", headers)
            assert error_of(refused, 403)["code"] == "browser_request_refused"
        assert complete(open_server, "anything").status_code == 200
        assert complete(open_server, "anything").status_code == 200
        assert "x-ratelimit-limit-requests" not in complete(open_server, "anything").headers
    finally:
        open_server.terminate()


# ---- a tenant name removed and added again: its prefix cache is forgotten (I5) ----------------

FORGET_PROMPT = " ".join(f"w{i}" for i in range(100, 164))  # 64 words: whole pages to hit


def _usage(server: ServerProcess, key: str, prompt: str = FORGET_PROMPT) -> dict[str, Any]:
    response = httpx.post(f"{server.base_url}/completions",
                          json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                          headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json()["usage"])


def _cached_tokens(server: ServerProcess, key: str, prompt: str = FORGET_PROMPT) -> int:
    return int(_usage(server, key, prompt)["prompt_tokens_details"]["cached_tokens"])


def test_a_tenant_removed_and_added_again_starts_with_an_empty_cache(srv: ServerProcess) -> None:
    """The security review's finding: a key added later under a removed tenant's name got cache
    hits on the old tenant's prompts (cached_tokens, and TTFT). Now the name's cache is forgotten
    by the reload that removes it; bob's cache is untouched."""
    _cached_tokens(srv, "key-alice")
    _cached_tokens(srv, "key-bob")
    assert _cached_tokens(srv, "key-alice") > 0  # primed
    without_alice = {k: v for k, v in KEYS.items() if k != "key-alice"}
    write_keys(srv, without_alice)
    removed = reload(srv)
    write_keys(srv, without_alice | {"key-alice-2": {"tenant": "alice"}})
    added = reload(srv)
    assert removed.status_code == added.status_code == 200
    assert _cached_tokens(srv, "key-alice-2") == 0, "the new key of the name hit the removed tenant's cache"
    assert _cached_tokens(srv, "key-alice-2") > 0  # the new tenant caches as any other
    assert _cached_tokens(srv, "key-bob") > 0
    assert removed.json()["tenants_forgotten"] == ["alice"] and added.json()["tenants_forgotten"] == []
    record = next(r for r in reversed(admin_records(srv)) if r.get("tenants_forgotten"))
    assert record["admin_action"] == "keys_reloaded" and record["tenants_forgotten"] == ["alice"]
    assert record["num_engines_told"] == 1
    assert srv.metric('kvseal_tenant_cache_forgets_total{reason="tenant_removed"}') >= 1


def test_a_stream_running_through_the_reload_does_not_feed_the_new_tenants_cache(srv: ServerProcess) -> None:
    """Every key of alice replaced by a new one in one reload (it may be another customer's): the
    old key's stream, not aborted, finishes, and neither its prompt nor its output is a hit for
    the new key."""
    write_keys(srv, {k: v for k, v in KEYS.items() if k != "key-alice"} | {"key-alice-3": {"tenant": "alice"}})
    body = {"prompt": FORGET_PROMPT, "max_tokens": 40, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{srv.base_url}/completions", json=body, headers={"Authorization": "Bearer key-alice"},
                      timeout=60) as response:
        lines = response.iter_lines()
        next(lines)
        answer = reload(srv)
        events = _events(list(lines))
    assert answer.status_code == 200
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    output = "".join(e["choices"][0]["text"] for e in events)
    first = _usage(srv, "key-alice-3")
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    # the new tenant's own prompt pages hit; none of the old stream's output pages does
    longer = _usage(srv, "key-alice-3", FORGET_PROMPT + output + " w7")
    assert longer["prompt_tokens_details"]["cached_tokens"] <= first["prompt_tokens"]
    assert longer["prompt_tokens"] > first["prompt_tokens"] + 8
    assert answer.json()["tenants_forgotten"] == ["alice"]  # every key of the name replaced: a new tenant


def test_the_operator_can_forget_a_tenants_cache(srv: ServerProcess) -> None:
    _cached_tokens(srv, "key-alice")
    assert _cached_tokens(srv, "key-alice") > 0
    assert error_of(admin(srv, "/admin/tenants/alice/forget-cache", {"Authorization": "Bearer key-bob"}), 403)
    answer = admin(srv, "/admin/tenants/alice/forget-cache")
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"object": "tenant.cache_forgotten", "tenant": "alice", "num_engines_told": 1}
    assert _cached_tokens(srv, "key-alice") == 0
    record = admin_records(srv)[-1]
    assert record["admin_action"] == "tenant_cache_forgotten" and record["tenants_forgotten"] == ["alice"]
    assert (record["by_tenant"], record["by_key_id"]) == ("ops", key_id("key-ops"))
