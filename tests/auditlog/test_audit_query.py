"""`kvseal audit` on a generated log that spans many rotations (one rotated file gzipped by the
operator), with planted requests: `--affected` with a window and a predicate finds exactly the
planted ones and their tenants, and the filters each select what they name."""

from __future__ import annotations

import csv
import gzip
import io
import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvseal.auditlog.output import csv_text
from kvseal.cli import main
from kvseal.server.audit import AuditLog, AuditRecord
from kvseal.server.audit_file import rotated_files

START = 1_764_900_000.0  # the fault's window: [START, END)
END = START + 3 * 3600
LONG = 32_768  # the incident's predicate: prompts of at least this many tokens on the bad decode engine
BAD_ENGINE = "decode-7f3a"
TENANTS = [f"tenant-{i}" for i in range(9)]


class Log:
    def __init__(self, path: Path) -> None:
        self.audit = AuditLog(str(path), include_prompts=False, max_bytes=64 * 1024)
        self.planted: dict[str, str] = {}  # request id -> tenant
        self.count = 0

    def add(self, at: float, *, planted: bool = False, **fields: Any) -> str:
        self.count += 1
        request_id = f"cmpl-{self.count:06d}"
        values: dict[str, Any] = {"tenant": random.choice(TENANTS), "outcome": "finished", "prompt_tokens": 40,
                                  "output_tokens": 20, "prefill_engine": "prefill-01", "decode_engine": "decode-02",
                                  "model": "m"} | fields
        self.audit.write(AuditRecord(request_id=request_id, endpoint="/v1/chat/completions", received_at=at,
                                     finished_at=at + 2.0, **values))
        if planted:
            self.planted[request_id] = values["tenant"]
        return request_id


@pytest.fixture(scope="module")
def incident_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Log]:
    random.seed(43)
    path = tmp_path_factory.mktemp("incident") / "audit.jsonl"
    log = Log(path)
    at = START - 6 * 3600
    while at < END + 6 * 3600:
        in_window = START <= at < END
        log.add(at)  # ordinary traffic
        if in_window and len(log.planted) < 155:
            outcome = random.choice(["finished", "finished", "finished", "aborted", "error"])
            log.add(at + 0.1, planted=True, prompt_tokens=LONG + random.randrange(60_000), decode_engine=BAD_ENGINE,
                    outcome=outcome, reason=None if outcome == "finished" else "client_disconnected")
            # look-alikes that were not affected: refused, or nothing generated, or a short prompt, or elsewhere
            log.add(at + 0.2, prompt_tokens=LONG + 5, decode_engine=BAD_ENGINE, outcome="rejected",
                    reason="tenant_concurrency_limit", output_tokens=None)
            log.add(at + 0.3, prompt_tokens=LONG + 7, decode_engine=BAD_ENGINE, outcome="aborted", output_tokens=0)
            log.add(at + 0.4, prompt_tokens=LONG - 1, decode_engine=BAD_ENGINE)
            log.add(at + 0.5, prompt_tokens=LONG * 2, decode_engine="decode-02")
        elif not in_window:
            log.add(at + 0.1, prompt_tokens=LONG * 2, decode_engine=BAD_ENGINE)  # long, on it, outside the window
        at += 30.0
    log.add(START - 1.0, prompt_tokens=LONG, decode_engine=BAD_ENGINE, planted=True)  # still running at START
    log.audit.close()
    assert len(log.planted) == 156
    rotated = rotated_files(path)
    assert len(rotated) >= 10
    middle = rotated[len(rotated) // 2][1]
    middle.with_name(middle.name + ".gz").write_bytes(gzip.compress(middle.read_bytes()))
    middle.unlink()
    return path, log


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, str]:
    assert main(["audit", *args]) == 0
    out, err = capsys.readouterr()
    return out, err


def affected_args(path: Path) -> list[str]:
    return ["--audit-log", str(path), "--since", str(START), "--until", str(END), "--affected",
            "--min-prompt-tokens", str(LONG), "--engine", BAD_ENGINE]


def test_affected_finds_exactly_the_planted_requests(incident_log: tuple[Path, Log],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path, log = incident_log
    out, err = run(capsys, *affected_args(path), "--format", "json")
    report = json.loads(out)
    assert err == ""
    assert {r["request_id"] for r in report["requests"]} == set(log.planted)
    assert report["num_requests"] == 156
    want: dict[str, int] = {}
    for tenant in log.planted.values():
        want[tenant] = want.get(tenant, 0) + 1
    assert report["tenants"] == want and report["num_tenants"] == len(want)
    assert report["predicate"] == f"--engine {BAD_ENGINE} --min-prompt-tokens {LONG}"


def test_affected_as_a_table_and_as_csv(incident_log: tuple[Path, Log], capsys: pytest.CaptureFixture[str]) -> None:
    path, log = incident_log
    out, _ = run(capsys, *affected_args(path))
    assert out.splitlines()[-1].startswith(f"156 requests of {len(set(log.planted.values()))} tenants could have "
                                           f"been affected: in flight during [2025-12-05T02:00:00.000Z, "
                                           f"2025-12-05T05:00:00.000Z)")
    out, err = run(capsys, *affected_args(path), "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert {r["request_id"] for r in rows} == set(log.planted) and rows[0]["received_at"].endswith("Z")
    assert err.startswith("156 requests of")


def test_affected_needs_a_window(incident_log: tuple[Path, Log], capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = incident_log
    assert main(["audit", "--audit-log", str(path), "--affected", "--since", str(START)]) != 0
    assert "--affected needs a window" in capsys.readouterr().err


def ids(out: str) -> list[str]:
    return [r["request_id"] for r in json.loads(out)["requests"]]


def test_filters(incident_log: tuple[Path, Log], capsys: pytest.CaptureFixture[str]) -> None:
    path, log = incident_log
    base = ["--audit-log", str(path), "--format", "json"]
    rejected = ids(run(capsys, *base, "--outcome", "rejected", "--reason", "tenant_concurrency_limit")[0])
    assert len(rejected) == 155
    one = next(iter(log.planted))
    assert ids(run(capsys, *base, "--request-id", one)[0]) == [one]
    tenant = log.planted[one]
    mine = json.loads(run(capsys, *base, "--tenant", tenant, "--since", str(START), "--until", str(END))[0])
    assert mine["requests"] and all(r["tenant"] == tenant for r in mine["requests"])
    both = ids(run(capsys, *base, "--tenant", tenant, "--tenant", "tenant-x", "--since", str(START),
                   "--until", str(END))[0])
    assert both == [r["request_id"] for r in mine["requests"]]
    sized = json.loads(run(capsys, *base, "--min-prompt-tokens", str(LONG - 1), "--max-prompt-tokens",
                           str(LONG - 1))[0])["requests"]
    assert len(sized) == 155 and {r["prompt_tokens"] for r in sized} == {LONG - 1}
    assert ids(run(capsys, *base, "--isolation-events")[0]) == []
    out, _ = run(capsys, "--audit-log", str(path), "--engine", "decode-none")
    assert out.startswith("(none)") and "0 requests in flight during [the start, the end)" in out


FORGED_ROW = "2026-11-30T09:00:00.000Z  cmpl-forged  alice  finished  40000  312  engine-1  m  /v1/completions"


def test_a_clients_text_cannot_forge_a_table_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A refused request is audited with the model name its client sent; printed raw, bob's name
    with a newline and an ANSI escape in it made the operator's table show a row of alice's.
    The table shows them as escapes, one record per line; JSON keeps the value exact."""
    model = f"x\n{FORGED_ROW}\r\t\x1b[2J\x85\u202e\\n"
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path), include_prompts=False)
    audit.write(AuditRecord(request_id="cmpl-bobs", endpoint="/v1/completions", received_at=START,
                            finished_at=START + 0.1, tenant="bob", outcome="rejected", reason="model_not_found",
                            http_status=404, rejected_by="frontend", model=model))
    audit.close()
    out, _ = run(capsys, "--audit-log", str(path), "--tenant", "bob")
    lines = out.splitlines()
    assert len(lines) == 3 and lines[0].startswith("received_at") and lines[2].startswith("1 requests"), out
    assert f"x\\n{FORGED_ROW}\\r\\t\\x1b[2J\\x85\\u202e\\\\n" in lines[1]
    assert all(ch.isprintable() for ch in out.replace("\n", ""))
    out, _ = run(capsys, "--audit-log", str(path), "--tenant", "bob", "--format", "json")
    assert json.loads(out)["requests"][0]["model"] == model
    out, _ = run(capsys, "--audit-log", str(path), "--tenant", "bob", "--format", "csv")
    assert [row["model"] for row in csv.DictReader(io.StringIO(out, newline=""))] == [model]
    lone_cr = csv_text([{"model": f"x\r{FORGED_ROW}", "n": 1}], ["model", "n"])  # no LF beside it to get it quoted
    assert list(csv.reader(io.StringIO(lone_cr, newline=""))) == [["model", "n"], [f"x\r{FORGED_ROW}", "1"]]
