"""`kvseal usage` against a real server whose audit log rotates many times: every request's
line is there, whole, exactly once, and the usage totals per tenant and per key equal the sum
of the `usage` the clients were sent."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from processes import kvseal_argv
from server_process import MAX_MODEL_LEN, ServerProcess
from tiny_server_model import make_server_model

from kvseal.server.audit import key_id_of
from kvseal.server.audit_file import rotated_files

KEYS = {"key-alice": {"tenant": "alice"}, "key-alice-2": {"tenant": "alice"}, "key-bob": {"tenant": "bob"}}
MAX_BYTES = 2048  # a few lines per file: dozens of rotations


@pytest.fixture(scope="module")
def rotating_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = make_server_model(tmp_path_factory.mktemp("models") / "tiny-llama")
    proc = ServerProcess(model, tmp_path_factory.mktemp("usage-server"), keys=KEYS,
                         extra_args=["--audit-log-max-bytes", str(MAX_BYTES)])
    proc.start()
    yield proc
    proc.terminate()


class Sent:
    """What the clients were told: each request's id and its `usage` (None when refused)."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.usage: dict[str, tuple[str, str, dict[str, Any] | None]] = {}  # id -> (tenant, key, usage)
        self.rejections: Counter[tuple[str, str]] = Counter()  # (tenant, code)

    def post(self, key: str, path: str, body: dict[str, Any]) -> None:
        response = httpx.post(f"{self.server.base_url}{path}", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {key}"})
        tenant = KEYS[key]["tenant"]
        if response.status_code == 200:
            self.usage[response.headers["x-request-id"]] = (tenant, key, response.json()["usage"])
        else:
            self.usage[response.headers["x-request-id"]] = (tenant, key, None)
            self.rejections[(tenant, response.json()["error"]["code"])] += 1

    def stream(self, key: str, body: dict[str, Any]) -> None:
        body = body | {"stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{self.server.base_url}/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {key}"}) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: {")]
            usage = next(c["usage"] for c in chunks if c.get("usage"))
            self.usage[response.headers["x-request-id"]] = (KEYS[key]["tenant"], key, usage)


def send_mix(sent: Sent) -> None:
    for index in range(12):
        key = ("key-alice", "key-alice-2", "key-bob")[index % 3]
        words = " ".join(f"w{10 + (index + j) % 40}" for j in range(3 + index % 5))
        sent.post(key, "/completions", {"prompt": words, "max_tokens": 1 + index % 4, "ignore_eos": True})
        if index % 2:
            sent.post(key, "/completions", {"prompt": words, "max_tokens": 2, "n": 2, "ignore_eos": True})
        if index % 3 == 0:
            sent.stream(key, {"prompt": words, "max_tokens": 3, "ignore_eos": True})
            sent.post(key, "/chat/completions", {"messages": [{"role": "user", "content": words}],
                                                 "max_tokens": 2, "ignore_eos": True})
        if index % 4 == 0:
            sent.post(key, "/completions", {"prompt": "w5 " * (MAX_MODEL_LEN + 1)})
            sent.post(key, "/completions", {"prompt": words, "temperature": -1})


def expected_totals(sent: Sent, by_key: bool) -> dict[tuple[str, ...], dict[str, int]]:
    totals: dict[tuple[str, ...], Counter[str]] = {}
    for tenant, key, usage in sent.usage.values():
        group = (tenant, key_id_of(f"Bearer {key}") or "") if by_key else (tenant,)
        counts = totals.setdefault(group, Counter())
        counts["requests"] += 1
        if usage is not None:
            counts["finished"] += 1
            counts["prompt_tokens"] += usage["prompt_tokens"]
            counts["completion_tokens"] += usage["completion_tokens"]
            counts["cached_tokens"] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {group: dict(counts) for group, counts in totals.items()}


def run_usage(server: ServerProcess, *args: str) -> dict[str, Any]:
    result = subprocess.run(kvseal_argv(["usage", "--audit-log", str(server.audit_path), "--format", "json",
                                         *args]), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_usage_equals_the_sum_of_the_responses_usage_across_rotations(rotating_server: ServerProcess) -> None:
    sent = Sent(rotating_server)
    send_mix(sent)
    files = [p for _, p in rotated_files(rotating_server.audit_path)] + [rotating_server.audit_path]
    assert len(files) >= 5, "the audit log rotated several times"
    ids = []
    for file in files:
        text = file.read_text()
        assert text.endswith("\n") and file.stat().st_size <= MAX_BYTES
        ids += [json.loads(line)["request_id"] for line in text.splitlines()]
    assert sorted(ids) == sorted(sent.usage), "every request's line, exactly once"

    for by_key in (False, True):
        report = run_usage(rotating_server, "--by", "key" if by_key else "tenant")
        names = ("tenant", "key_id") if by_key else ("tenant",)
        got = {tuple(row[n] for n in names): row for row in report["rows"]}
        want = expected_totals(sent, by_key)
        assert set(got) == set(want)
        for group, counts in want.items():
            row = got[group]
            for name in ("requests", "finished", "prompt_tokens", "completion_tokens", "cached_tokens"):
                assert row[name] == counts.get(name, 0), (group, name, row)
    rows = run_usage(rotating_server)["rows"]
    got_rejections = {(row["tenant"], code): n for row in rows for code, n in row["rejections"].items()}
    assert got_rejections == dict(sent.rejections)


def test_usage_windows_and_formats(rotating_server: ServerProcess) -> None:
    sent = Sent(rotating_server)
    sent.post("key-bob", "/completions", {"prompt": "w7 w8", "max_tokens": 2, "ignore_eos": True})
    record = rotating_server.audit_for(next(iter(sent.usage)))
    since = record["received_at"]
    after = run_usage(rotating_server, "--since", str(since))["rows"]
    assert [(r["tenant"], r["requests"], r["completion_tokens"]) for r in after] == [("bob", 1, 2)]
    assert run_usage(rotating_server, "--until", str(since - 3600))["rows"] == []
    csv = subprocess.run(kvseal_argv(["usage", "--audit-log", str(rotating_server.audit_path), "--format", "csv",
                                      "--since", str(since)]), capture_output=True, text=True, timeout=120)
    header, row = csv.stdout.splitlines()
    assert header.startswith("tenant,requests,finished,") and row.startswith("bob,1,1,")
