"""The verdict's rules that no server run isolates well: a run that could not see a leak, and
the summary's error count past the listed ones."""

from __future__ import annotations

import json
import random

from kvseal.canary.markers import Marker, MarkerFactory
from kvseal.canary.plan import TOOL_NAME, Endpoint, PlannedRequest
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


def tool_result(index: int, arguments: str, is_stream: bool = False) -> RequestResult:
    """A chat request that forced a call to the canary's tool, answered with these arguments."""
    marker = marker_of(index)
    request = PlannedRequest(marker.request_id, marker.tenant, index % 2, Endpoint.CHAT, is_stream, False, None,
                             marker, f"{marker.text} is my code.", 128, is_tool_call=True)
    call = f"choices[0].{'delta' if is_stream else 'message'}.tool_calls[0]"
    fields = {f"{call}.function.name": (TOOL_NAME,), f"{call}.function.arguments": (arguments,)}
    return RequestResult(request, Outcome.OK, 200, fields, f"s{index}", None, 0.1)


def test_another_requests_marker_in_a_calls_arguments_is_a_leak_named_by_its_field() -> None:
    seeing = [result(i, Outcome.OK, f"again {marker_of(i).text}") for i in range(2)]
    own = tool_result(2, json.dumps({"code": marker_of(2).text}))
    foreign = tool_result(3, json.dumps({"code": marker_of(2).text}), is_stream=True)
    report = report_of([*seeing, own, foreign])
    assert not report["verdict"]["passed"]
    [leak] = report["leaks"]
    assert (leak["request_id"], leak["foreign_request_id"]) == ("c000003", "c000002")
    assert leak["fields"] == ["choices[0].delta.tool_calls[0].function.arguments"]
    assert report["paths"]["tool_calls"] == {"asked": 2, "completed": 2, "with_call": 2, "not_exercised": None}
    # a forced call's marker is the grammar's, not the model's: it is no evidence of the run's power
    assert report["own_marker_echoes"]["responses"] == 2
    assert report["own_marker_echoes"]["tool_requests_not_counted"] == 2


def test_tool_calls_not_sent_are_reported_as_not_exercised() -> None:
    results = [result(i, Outcome.OK, f"again {marker_of(i).text}") for i in range(2)]
    why = "the server parses no tool calls (start it with --tool-call-parser; ...)"
    report = build_report(analyse(results), NO_EVIDENCE, {"num_requests": 2, "tools_not_sent": why}, TENANCY)
    assert report["verdict"]["passed"], report["verdict"]
    assert report["paths"]["tool_calls"] == {"asked": 0, "completed": 0, "with_call": 0, "not_exercised": why}
    [row] = [line for line in summary_table(report).splitlines() if line.startswith("tool calls")]
    assert row.endswith(f"not exercised: {why}")
    # a call cut short (no name read) is asked and completed, but has no call
    cut = tool_result(2, "")
    cut = RequestResult(cut.request, Outcome.OK, 200, {}, "s2", None, 0.1)
    assert report_of([*results, cut])["paths"]["tool_calls"]["with_call"] == 0
