"""The verdict's rules that no server run isolates well: a run that could not see a leak, and
the summary's error count past the listed ones."""

from __future__ import annotations

import random

from kvseal.canary.markers import Marker, MarkerFactory
from kvseal.canary.plan import Endpoint, PlannedRequest
from kvseal.canary.report import MAX_LISTED, analyse, build_report, summary_table
from kvseal.canary.runner import Outcome, RequestResult

TENANCY = {"open_door": None, "prefix_probe": {"prompt_chars": 600, "pairs": []}}
NO_EVIDENCE = {"available": False, "reason": "not a kvseal server"}


MARKERS = MarkerFactory(random.Random(7))
_DRAWN: dict[int, Marker] = {}


def marker_of(index: int) -> Marker:
    """Request `index`'s marker (drawn once: markers share no window, as in a run)."""
    if index not in _DRAWN:
        _DRAWN[index] = MARKERS.new(f"c{index:06d}", f"tenant-{index % 2}")
    return _DRAWN[index]


def result(index: int, outcome: Outcome, text: str, status: int = 200) -> RequestResult:
    marker = marker_of(index)
    request = PlannedRequest(marker.request_id, marker.tenant, index % 2, Endpoint.COMPLETIONS, False, False, None,
                             marker, f"{marker.text} is my code.", 16)
    fields = {"choices[0].text": (text,)} if text else {}
    return RequestResult(request, outcome, status, fields, f"s{index}", None if status < 300 else "oops", 0.1)


def report_of(results: list[RequestResult]) -> dict:
    return build_report(analyse(results), NO_EVIDENCE, {"num_requests": len(results)}, TENANCY)


def test_a_run_whose_answers_never_repeat_their_own_marker_fails() -> None:
    """With too few tokens (or a model that never repeats), zero leaks means nothing."""
    blind = report_of([result(i, Outcome.OK, "short") for i in range(4)])
    assert not blind["verdict"]["passed"]
    assert any("could not have seen a leak" in reason for reason in blind["verdict"]["reasons"])
    seeing = report_of([result(i, Outcome.OK, f"again {marker_of(i).text}") for i in range(4)])
    assert seeing["verdict"]["passed"], seeing["verdict"]


def test_the_summary_counts_every_server_error_not_only_the_listed_ones() -> None:
    results = [result(0, Outcome.OK, f"again {marker_of(0).text}")]
    results += [result(i, Outcome.SERVER_ERROR, "", status=500) for i in range(1, MAX_LISTED + 12)]
    report = report_of(results)
    assert len(report["server_errors"]) == MAX_LISTED and report["num_server_errors"] == MAX_LISTED + 11
    [row] = [line for line in summary_table(report).splitlines() if line.startswith("5xx or stream errors")]
    assert row.split()[-1] == str(MAX_LISTED + 11)
