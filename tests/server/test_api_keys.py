"""The API keys file and the bearer header: strict parsing, keys never echoed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from kvseal.errors import ConfigError
from kvseal.server.auth import DEFAULT_MAX_CONCURRENT_REQUESTS, MAX_LIMIT, ApiKeyTable, Tenant
from kvseal.server.config import ServerConfig
from kvseal.server.errors import ApiError


def load(tmp_path: Path, content: Any) -> ApiKeyTable:
    path = tmp_path / "keys.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return ApiKeyTable.load(str(path))


def test_keys_map_to_tenants_with_limits(tmp_path: Path) -> None:
    table = load(tmp_path, {"k1": {"tenant": "a", "max_concurrent_requests": 2}, "k2": {"tenant": "b"},
                            "k3": {"tenant": "a", "max_concurrent_requests": 2}})
    assert table.authenticate("Bearer k1") == Tenant("a", max_concurrent_requests=2)
    assert table.authenticate("bearer  k3 ") == Tenant("a", max_concurrent_requests=2)
    assert table.authenticate("Bearer k2").name == "b"
    assert [t.name for t in table.tenants] == ["a", "b"]


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic k1", "k1", "Bearer k1x", "Bearer K1"])
def test_bad_authorization_is_401(tmp_path: Path, header: str | None) -> None:
    table = load(tmp_path, {"k1": {"tenant": "a"}})
    with pytest.raises(ApiError) as info:
        table.authenticate(header)
    assert info.value.status == 401 and info.value.code == "invalid_api_key"


@pytest.mark.parametrize("content", [
    "not json", "[]", {}, {"secret-key-1": "a"}, {"secret-key-1": {"tenant": ""}},
    {"secret-key-1": {"tenant": "a", "max_tokens": 0}}, {"secret-key-1": {"tenant": "a", "max_tokens": True}},
    {"secret-key-1": {"tenant": "a", "rate": 1}}, {"secret key": {"tenant": "a"}},
    {"secret-key-1": {"tenant": "a", "max_tokens": 5}, "secret-key-2": {"tenant": "a"}},
    # a key listed twice: `json` would keep the last entry, moving the key to another tenant
    '{"secret-key-1": {"tenant": "a"}, "secret-key-1": {"tenant": "b"}}',
    '{"secret-key-1": {"tenant": "a", "tenant": "b"}}',  # a field repeated in one entry
    {"secret-key-1": {"tenant": "-"}},  # what the audit log's answers show for requests no tenant made
    {"secret-key-1": {"tenant": "a\u0000b"}}, {"secret-key-1": {"tenant": "a\nb"}},
])
def test_bad_keys_file_stops_start_up_without_echoing_keys(tmp_path: Path, content: Any) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, content)
    assert "secret-key" not in str(info.value)


@pytest.mark.parametrize("field", ["max_concurrent_requests", "max_tokens", "requests_per_minute",
                                   "tokens_per_minute"])
def test_a_limit_above_the_maximum_is_refused(tmp_path: Path, field: str) -> None:
    """A limit a float cannot hold (10**400, valid JSON as digits) failed every request of its
    tenant with a 500 that left no audit line and kept its slot; the file is refused instead."""
    assert load(tmp_path, {"secret-key-1": {"tenant": "a", field: MAX_LIMIT}}).keys
    for value in (MAX_LIMIT + 1, 10**400):
        with pytest.raises(ConfigError) as info:
            load(tmp_path, {"secret-key-1": {"tenant": "a", field: value}})
        assert field in str(info.value) and f"{MAX_LIMIT:_}" in str(info.value)
        assert len(str(info.value)) < 300  # not the 400 digits


def test_missing_keys_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        ApiKeyTable.load(str(tmp_path / "absent.json"))


def test_without_a_keys_file_everyone_is_default() -> None:
    table = ApiKeyTable.load(None)
    assert table.is_open
    assert table.authenticate(None) == table.authenticate("Bearer anything") == Tenant("default")


@pytest.mark.parametrize(("host", "is_loopback"), [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                                    ("0.0.0.0", False), ("10.1.2.3", False), ("example.org", False)])
def test_loopback_detection_for_the_open_server_warning(host: str, is_loopback: bool) -> None:
    assert ServerConfig(host=host).is_loopback is is_loopback


def test_server_config_refuses_bad_values() -> None:
    with pytest.raises(ConfigError, match="port"):
        ServerConfig(port=70000)
    with pytest.raises(ConfigError, match="max-body-bytes"):
        ServerConfig(max_body_bytes=10)
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    assert ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes").tool_call_parser == "hermes"


def test_admin_keys_gate_the_operator_routes(tmp_path: Path) -> None:
    table = load(tmp_path, {"k-ops": {"tenant": "ops", "admin": True}, "k-a": {"tenant": "a", "admin": False},
                            "k-b": {"tenant": "b"}})
    table.authenticate_admin("Bearer k-ops")
    for header, status in ((None, 401), ("Bearer nope", 401), ("Bearer k-a", 403), ("Bearer k-b", 403)):
        with pytest.raises(ApiError) as info:
            table.authenticate_admin(header)
        assert info.value.status == status
    ApiKeyTable().authenticate_admin(None)  # without a keys file the routes stay open
    with pytest.raises(ConfigError, match="admin"):
        load(tmp_path, {"k": {"tenant": "a", "admin": "yes"}})


def test_hashed_and_revoked_entries(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"k-hashed").hexdigest()
    table = load(tmp_path, {f"sha256:{digest}": {"tenant": "h"}, "k-old": {"tenant": "h", "revoked": True},
                            "k-a": {"tenant": "a"}})
    assert table.authenticate("Bearer k-hashed").name == "h"
    for header in ("Bearer k-old", f"Bearer sha256:{digest}"):
        with pytest.raises(ApiError):
            table.authenticate(header)
    assert [k.key_id for k in table.keys if k.tenant.name == "h"] == [digest[:12]]
    for bad in ({"sha256:abc": {"tenant": "h"}}, {f"sha256:{digest.upper()}": {"tenant": "h"}},
                {"k-hashed": {"tenant": "h"}, f"sha256:{digest}": {"tenant": "h"}},
                {"k": {"tenant": "h", "revoked": "yes"}}):
        with pytest.raises(ConfigError):
            load(tmp_path, bad)


def test_a_tenant_without_a_concurrency_limit_gets_the_default(tmp_path: Path) -> None:
    table = load(tmp_path, {"k": {"tenant": "a", "requests_per_minute": 5, "tokens_per_minute": 100}})
    assert table.authenticate("Bearer k") == Tenant("a", DEFAULT_MAX_CONCURRENT_REQUESTS, None, 5, 100)
    assert ApiKeyTable.load(None).authenticate(None).max_concurrent_requests is None  # one tenant: no cap
