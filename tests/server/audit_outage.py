"""The audit-log outage (I8), played against a running server (colocated or PD).

The server's --audit-log is a symlink. Pointing it at /dev/full is a real full disk (every
write fails with ENOSPC); pointing it back at the real file gives the disk room again. The
server re-resolves the path before each line, so it sees both switches without a restart.

What must hold (`play_outage`):
- no answer is a success unless its line is already in the log, and the one that was being
  generated when the disk filled is withheld: 503 `audit_unavailable` with Retry-After, or a
  stream that ends with that error event, never with a normal finish;
- while the log fails, new generation requests get 503 `audit_unavailable`, /tokenize too,
  bad input still gets its 400, /health says why (503) and /metrics counts the failures;
- once the log can be written the server serves again by itself (no restart), and every
  request of the run has exactly one line: late lines say `audit_unavailable` for each
  answer that was withheld, and refusals keep their status.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from processes import read_jsonl, wait_for

DEV_FULL = "/dev/full"
AUDIT_UNAVAILABLE = "audit_unavailable"
PROMPT = {"prompt": "w5 w6 w7 w8", "max_tokens": 4, "ignore_eos": True}


def point(link: Path, target: str | Path) -> None:
    """Switch the symlink `link` to `target` atomically."""
    tmp = link.with_name(link.name + ".tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


def linked_audit_log(folder: Path) -> tuple[Path, Path]:
    """(the path to give --audit-log, the real file it names)."""
    folder.mkdir(parents=True, exist_ok=True)
    link, real = folder / "audit.jsonl", folder / "audit-real.jsonl"
    real.touch()
    point(link, real)
    return link, real


@dataclass
class Answer:
    request_id: str
    status: int
    error_code: str | None = None
    stream_finished: bool = False  # a stream whose last chunk carried a finish reason, with no error event
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Outage:
    url: str  # the server, without /v1
    link: Path
    real: Path
    key: str
    admin_key: str
    answers: list[Answer] = field(default_factory=list)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def post(self, path: str, body: dict[str, Any]) -> Answer:
        response = httpx.post(f"{self.url}{path}", json=body, headers=self.auth, timeout=60)
        code = response.json()["error"]["code"] if response.status_code >= 400 else None
        answer = Answer(response.headers["x-request-id"], response.status_code, code, headers=dict(response.headers))
        self._check_audited(answer)
        return answer

    def stream(self, body: dict[str, Any]) -> Answer:
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body | {"stream": True}, headers=self.auth,
                          timeout=60) as response:
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
            answer = Answer(response.headers["x-request-id"], response.status_code)
        payloads = [json.loads(e) for e in events if e != "[DONE]"]
        errors = [p["error"] for p in payloads if "error" in p]
        answer.error_code = errors[0]["code"] if errors else None
        answer.stream_finished = not errors and any(c.get("finish_reason") for p in payloads for c in p["choices"])
        self._check_audited(answer)
        return answer

    def lines(self) -> list[dict[str, Any]]:
        return read_jsonl(self.real)

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=10)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", headers={"Authorization": f"Bearer {self.admin_key}"},
                         timeout=10).text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert match, f"{name} not in /metrics"
        return float(match.group(1))

    def _check_audited(self, answer: Answer) -> None:
        """A success must already have its line, as a success, when the client has it."""
        self.answers.append(answer)
        if answer.status == 200 and answer.error_code is None:
            mine = [r for r in self.lines() if r["request_id"] == answer.request_id]
            assert mine, f"request {answer.request_id} was answered 200 without its audit line"
            assert mine[0]["outcome"] == "finished" and not mine[0].get("written_late"), mine


def assert_withheld(answer: Answer) -> None:
    assert answer.status == 503 and answer.error_code == AUDIT_UNAVAILABLE, answer
    assert answer.headers.get("retry-after", "").isdigit(), answer.headers


def play_outage(outage: Outage) -> None:
    assert outage.post("/v1/completions", PROMPT).status == 200
    point(outage.link, DEV_FULL)
    _while_full(outage)
    point(outage.link, outage.real)
    _recovers(outage)
    # The second time the disk fills, a stream is the first to end: its 200 is already out.
    point(outage.link, DEV_FULL)
    streamed = outage.stream(PROMPT)
    assert streamed.status == 200 and streamed.error_code == AUDIT_UNAVAILABLE and not streamed.stream_finished
    point(outage.link, outage.real)
    _recovers(outage)
    _every_request_has_one_line(outage)


def _while_full(outage: Outage) -> None:
    assert_withheld(outage.post("/v1/completions", PROMPT))  # generated, but its line failed: withheld
    assert_withheld(outage.post("/v1/completions", PROMPT))  # refused before the engine
    assert_withheld(outage.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}],
                                                         "max_tokens": 2}))
    assert_withheld(outage.post("/tokenize", {"prompt": "w5 w6"}))
    empty = outage.post("/v1/completions", {"prompt": [], "max_tokens": 2})  # refused by admission (I1)
    assert (empty.status, empty.error_code) == (400, "invalid_parameter"), empty  # bad input stays a 400
    health = outage.health()
    assert health.status_code == 503 and health.json()["error"]["code"] == AUDIT_UNAVAILABLE, health.text
    assert "No space left on device" in health.json()["error"]["message"]
    assert outage.metric("kvseal_audit_log_up") == 0
    assert outage.metric("kvseal_audit_write_failures_total") >= 1


def _recovers(outage: Outage) -> None:
    wait_for(lambda: outage.health().status_code == 200, "the server to recover from the audit outage by itself")
    assert outage.post("/v1/completions", PROMPT).status == 200
    assert outage.post("/tokenize", {"prompt": "w5 w6"}).status == 200
    assert outage.metric("kvseal_audit_log_up") == 1 and outage.metric("kvseal_audit_records_pending") == 0


def _every_request_has_one_line(outage: Outage) -> None:
    by_id: dict[str, list[dict[str, Any]]] = {}
    for line in outage.lines():
        by_id.setdefault(line["request_id"], []).append(line)
    withheld = []
    for answer in outage.answers:
        lines = by_id.get(answer.request_id, [])
        assert len(lines) == 1, f"{answer}: {lines}"
        line = lines[0]
        if answer.error_code == AUDIT_UNAVAILABLE:
            assert (line["outcome"], line["reason"], line["written_late"]) == ("error", AUDIT_UNAVAILABLE, True), line
            withheld.append(line)
        elif answer.status == 400:
            assert (line["outcome"], line["http_status"], line["written_late"]) == ("rejected", 400, True), line
        else:
            assert line["outcome"] == "finished" and not line.get("written_late"), line
    # Both ways an answer is withheld happened: generated and then withheld (its tokens are
    # recorded), and refused before the engine (503, nothing generated).
    assert any(line.get("output_tokens") == PROMPT["max_tokens"] for line in withheld), withheld
    assert any(line.get("http_status") == 503 and "output_tokens" not in line for line in withheld), withheld
