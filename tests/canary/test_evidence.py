"""Server evidence from /metrics: deltas over the run, allocator state, missing metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from processes import free_port

from kvseal.canary.evidence import MetricsSnapshot, Sample, _parse, evidence
from kvseal.canary.report import _evidence_reasons, _evidence_rows, preemptions
from kvseal.cli import main

BEFORE = """\
# TYPE kvseal_requests counter
kvseal_requests_total{tenant="a",outcome="finished"} 5.0
# TYPE kvseal_kv_pages_used gauge
kvseal_kv_pages_used 0.0
# TYPE kvseal_kv_pages_free gauge
kvseal_kv_pages_free 32.0
"""
AFTER = """\
# TYPE kvseal_requests counter
kvseal_requests_total{tenant="a",outcome="finished"} 9.0
kvseal_requests_total{tenant="b",outcome="aborted"} 2.0
# TYPE kvseal_rejections counter
kvseal_rejections_total{reason="context_length_exceeded"} 1.0
# TYPE kvseal_isolation_violations counter
kvseal_isolation_violations_total 3.0
# TYPE kvseal_kv_pages_used gauge
kvseal_kv_pages_used 2.0
# TYPE kvseal_kv_pages_free gauge
kvseal_kv_pages_free 30.0
"""


def test_deltas_and_allocator_state() -> None:
    ev = evidence(MetricsSnapshot(_parse(BEFORE)), MetricsSnapshot(_parse(AFTER)))
    assert ev["requests_by_outcome"] == {"aborted": 2.0, "finished": 4.0}
    assert ev["rejections_by_reason"] == {"context_length_exceeded": 1.0}
    assert ev["isolation_violations"] == 3.0
    assert ev["pages_scrubbed"] == "unavailable" and ev["scrub_mode"] == "unavailable"
    assert ev["allocator_after_run"]["is_idle"] is False
    reasons = _evidence_reasons(ev)
    assert any("3 isolation checks" in r for r in reasons) and any("2 pages used" in r for r in reasons)


SCRUB = """\
# TYPE kvseal_kv_pages_scrubbed counter
kvseal_kv_pages_scrubbed_total {scrubbed}
# TYPE kvseal_kv_scrub_mode gauge
kvseal_kv_scrub_mode{{mode="{mode}"}} 1.0
"""


@pytest.mark.parametrize(("mode", "before", "after", "row"), [
    ("free", 4.0, 10.0, "6"),
    ("off", 0.0, 0.0, "0 (scrub off: a freed page keeps its KV until its next owner overwrites it)"),
])
def test_pages_scrubbed_is_read_beside_the_scrub_mode(mode: str, before: float, after: float, row: str) -> None:
    ev = evidence(MetricsSnapshot(_parse(BEFORE + SCRUB.format(scrubbed=before, mode=mode))),
                  MetricsSnapshot(_parse(AFTER + SCRUB.format(scrubbed=after, mode=mode))))
    assert ev["pages_scrubbed"] == after - before and ev["scrub_mode"] == mode
    rows = dict(_evidence_rows(ev))
    assert rows["server: pages scrubbed"] == row and rows["server: KV scrub mode"] == mode


def test_missing_metrics_are_unavailable_not_failures() -> None:
    before = MetricsSnapshot(_parse(BEFORE))
    after = MetricsSnapshot([Sample("kvseal_kv_pages_used", (), 0.0), Sample("kvseal_kv_pages_free", (), 32.0)])
    ev = evidence(before, after)
    assert ev["isolation_violations"] == "unavailable" and ev["requests_by_outcome"] == "unavailable"
    assert ev["allocator_after_run"]["is_idle"] is True
    assert _evidence_reasons(ev) == []
    closed = evidence(before, MetricsSnapshot(unavailable="GET /metrics answered 401"))
    assert closed == {"available": False, "reason": "GET /metrics answered 401"}
    assert _evidence_reasons(closed) == []


def test_unreachable_server_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(["a", "b"]))
    status = main(["canary", "--base-url", f"http://127.0.0.1:{free_port()}", "--keys", str(keys),
                   "--report", str(tmp_path / "r.json"), "--no-progress"])
    assert status == 2
    assert "cannot reach" in capsys.readouterr().err


PREEMPTIONS = "# TYPE kvseal_num_preemptions gauge\nkvseal_num_preemptions {count}\n"


@pytest.mark.parametrize(("before", "after", "reported"), [
    (PREEMPTIONS.format(count=3.0), PREEMPTIONS.format(count=10.0), 7.0),
    ("", PREEMPTIONS.format(count=10.0), "unknown"),  # not exported before the run: no baseline
    (PREEMPTIONS.format(count=10.0), PREEMPTIONS.format(count=0.0), "unknown"),  # an engine restarted
])
def test_preemptions_are_the_gauges_rise_or_unknown(before: str, after: str, reported: float | str) -> None:
    ev = evidence(MetricsSnapshot(_parse(BEFORE + before)), MetricsSnapshot(_parse(AFTER + after)))
    pre = preemptions(ev)
    assert pre["server_reported"] == reported
    assert (pre["why_unknown"] is None) == (reported != "unknown")


def test_preemptions_are_unknown_when_metrics_are_closed() -> None:
    closed = evidence(MetricsSnapshot(_parse(BEFORE)), MetricsSnapshot(unavailable="GET /metrics answered 401"))
    assert preemptions(closed) == {"server_reported": "unknown", "why_unknown": "GET /metrics answered 401"}
