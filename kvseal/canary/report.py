"""Findings, verdict, summary table and JSON report of one canary run.

The run fails on any foreign marker in a response (a leak: in any choice's text, any other
string of its message such as reasoning or tool calls, a forced call's arguments among them,
any logprob token string or bytes, chosen or alternative, read rank by rank and in any rank
order, or prompt_logprobs; the report names the field), any oversized prompt answered 2xx,
any 5xx (or error event inside a stream), any request without a complete answer
(transport error, truncated stream), any normal request refused (4xx: an answer the run could
not see is no evidence), a run in which no response repeated its own marker (it could not
have seen a leak), the tenancy probes' findings (`probes.py`: a server answering a made-up
key, a key served another key's cached prompt), and, where the server reports them, any
isolation check it tripped or pages still owned after the run drained.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvseal.canary.markers import MarkerIndex, Sighting
from kvseal.canary.plan import TOOL_NAME, Endpoint, echo_prefill
from kvseal.canary.probes import probe_reasons, probe_summary
from kvseal.canary.runner import Outcome, RequestResult

MAX_LISTED = 50  # errors listed in the JSON report (all are counted)
ANY_RANK = "[any rank]"  # after a field of alternatives: found on a path through them in any rank order


@dataclass(frozen=True)
class Leak:
    request_id: str
    server_request_id: str | None
    tenant: str
    foreign_request_id: str
    foreign_tenant: str
    matched: str
    is_full: bool
    fields: tuple[str, ...]  # every response field the marker was found in (runner.ResponseFields)

    def as_dict(self) -> dict[str, Any]:
        return self.__dict__ | {"fields": list(self.fields)}


@dataclass
class Findings:
    results: list[RequestResult]
    leaks: list[Leak] = field(default_factory=list)
    same_tenant_crossings: list[Leak] = field(default_factory=list)
    # Completed responses that repeated their own marker: the run's power. A model that never
    # repeats its own marker would not repeat a foreign one either, and then zero leaks means little.
    num_own_echoes: int = 0

    @property
    def outcomes(self) -> Counter[str]:
        return Counter(r.outcome.value for r in self.results)

    @property
    def oversized(self) -> dict[str, int]:
        counts = {"4xx": 0, "2xx": 0, "5xx": 0, "other": 0}
        for r in self.results:
            if r.request.is_oversized:
                counts[_status_class(r.status)] += 1
        return counts

    @property
    def server_errors(self) -> list[RequestResult]:
        return [r for r in self.results if r.outcome is Outcome.SERVER_ERROR]

    @property
    def refused(self) -> list[RequestResult]:
        """Normal (not oversized) requests answered 4xx: answers the run could not see."""
        return [r for r in self.results if r.outcome is Outcome.REJECTED and not r.request.is_oversized]

    @property
    def unanswered(self) -> list[RequestResult]:
        return [r for r in self.results if r.outcome in (Outcome.TRANSPORT_ERROR, Outcome.INCOMPLETE)]


def _status_class(status: int | None) -> str:
    if status is None:
        return "other"
    return {2: "2xx", 4: "4xx", 5: "5xx"}.get(status // 100, "other")


def analyse(results: list[RequestResult]) -> Findings:
    """Check every field of every response for every other request's marker: one finding per
    (response, foreign marker), naming each field it was in and its longest match."""
    index = MarkerIndex(r.request.marker for r in results)
    findings = Findings(results)
    for r in results:
        sightings: dict[str, list[tuple[str, Sighting]]] = {}
        for name, texts in r.fields.items():
            for seen in {s.marker.request_id: s for text in texts for s in index.find(text)}.values():
                sightings.setdefault(seen.marker.request_id, []).append((name, seen))
        for name, positions in r.positions.items():
            for seen in index.find_on_paths(positions):
                sightings.setdefault(seen.marker.request_id, []).append((f"{name}{ANY_RANK}", seen))
        for request_id, found in sightings.items():
            if request_id == r.request.request_id:
                findings.num_own_echoes += r.outcome is Outcome.OK and _is_generated(r, [name for name, _ in found])
                continue
            best = max((seen for _, seen in found), key=lambda seen: len(seen.matched))
            leak = Leak(r.request.request_id, r.server_request_id, r.request.tenant, request_id, best.marker.tenant,
                        best.matched, best.is_full, tuple(name for name, _ in found))
            target = findings.leaks if best.marker.tenant != r.request.tenant else findings.same_tenant_crossings
            target.append(leak)
    return findings


def _is_generated(r: RequestResult, names: list[str]) -> bool:
    """Whether its own marker in these fields shows the model repeated it: not where the
    server returns the prompt itself (prompt_logprobs; every field of a request with echo), nor
    anywhere in a forced call's answer (the call, its tokens: the grammar writes the marker the
    tool's schema holds)."""
    return not (r.request.is_echo or r.request.is_tool_call) and any("prompt_logprobs" not in name for name in names)


def paths(findings: Findings, tools_not_sent: str | None = None) -> dict[str, Any]:
    """Which response paths the completed requests exercised: asked for, and actually answered
    (a server may ignore `n` or `logprobs`; then the run did not check that path).
    `tools_not_sent`: why the run left its tool requests out (`probes.tools_refusal`)."""
    done = [r for r in findings.results if r.outcome is Outcome.OK]
    several = [r for r in done if r.request.n > 1]
    with_logprobs = [r for r in done if r.request.logprobs is not None]
    with_prompt_logprobs = [r for r in done if r.request.prompt_logprobs is not None]
    with_echo = [r for r in done if r.request.is_echo]
    return {
        "n_gt_1": {"completed": len(several),
                   "with_every_choice": sum(len(_choices(r)) >= r.request.n for r in several)},
        "logprobs": {"completed": len(with_logprobs),
                     "with_tokens": sum(any(".logprobs." in f and "top" not in f for f in r.fields)
                                        for r in with_logprobs),
                     "with_top_alternatives": sum(any("top_logprobs" in f for f in r.fields) for r in with_logprobs)},
        "prompt_logprobs": {"completed": len(with_prompt_logprobs),
                            "answered": sum(any("prompt_logprobs" in f for f in r.positions)
                                            for r in with_prompt_logprobs)},
        "echo": {"completed": len(with_echo), "answered": sum(_is_echoed(r) for r in with_echo)},
        "reasoning_or_tool_calls": sum(any(_is_parsed_field(f) for f in r.fields) for r in done),
        "tool_calls": _tool_calls(findings, tools_not_sent),
    }


def _tool_calls(findings: Findings, tools_not_sent: str | None) -> dict[str, Any]:
    """Tool requests asked and completed, and those with a call to the canary's tool in every
    choice (the parser read it); why none was sent, where none was."""
    asked = [r for r in findings.results if r.request.is_tool_call]
    done = [r for r in asked if r.outcome is Outcome.OK]
    not_exercised = tools_not_sent or (None if asked else "no tool requests in the plan (--tools-fraction)")
    return {"asked": len(asked), "completed": len(done), "with_call": sum(_has_every_call(r) for r in done),
            "not_exercised": not_exercised}


def _has_every_call(r: RequestResult) -> bool:
    """Whether each of the request's choices holds a call named after the canary's tool."""
    names = [(field, texts) for field, texts in r.fields.items()
             if ".tool_calls[" in field and field.endswith(".function.name")]
    return all(any(field.startswith(f"choices[{i}].") and TOOL_NAME in texts for field, texts in names)
               for i in range(r.request.n))


def _is_echoed(r: RequestResult) -> bool:
    """Whether the first choice starts with what echo returns (the prompt; chat: the last message)."""
    expected = r.request.prompt if r.request.endpoint is Endpoint.COMPLETIONS else echo_prefill(r.request.marker)
    texts = [t for name in ("choices[0].text", "choices[0].message.content", "choices[0].delta.content")
             for t in r.fields.get(name, ())]
    return any(t.startswith(expected) for t in texts)


def _is_parsed_field(name: str) -> bool:
    """A field a reasoning or tool-call parser adds to a chat message."""
    return ".reasoning" in name or ".tool_calls" in name


def _choices(r: RequestResult) -> set[str]:
    return {name.split(".")[0] for name in r.fields if name.startswith("choices[")}


def verdict(findings: Findings, evidence: dict[str, Any], tenancy: dict[str, Any]) -> list[str]:
    """Reasons the run failed; empty means it passed."""
    reasons = [tenancy["open_door"]] if tenancy["open_door"] else []
    reasons += probe_reasons(tenancy["prefix_probe"])
    if findings.leaks:
        tenants = sorted({(leak.foreign_tenant, leak.tenant) for leak in findings.leaks})
        fields = Counter(name for leak in findings.leaks for name in leak.fields)
        reasons.append(f"{len(findings.leaks)} foreign markers in responses (from -> to: "
                       f"{', '.join(f'{a} -> {b}' for a, b in tenants[:8])}; in fields: "
                       f"{', '.join(f'{name} x{n}' for name, n in fields.most_common(6))})")
    if findings.oversized["2xx"]:
        reasons.append(f"{findings.oversized['2xx']} oversized prompts answered 2xx")
    if findings.server_errors:
        reasons.append(f"{len(findings.server_errors)} requests answered 5xx or an error event")
    if findings.unanswered:
        reasons.append(f"{len(findings.unanswered)} requests without a complete answer (transport error or "
                       f"truncated stream)")
    if findings.refused:
        codes = Counter((r.error or f"HTTP {r.status}").split(":")[0] for r in findings.refused)
        reasons.append(f"{len(findings.refused)} normal requests refused 4xx "
                       f"({', '.join(f'{code} x{n}' for code, n in codes.most_common(4))}): answers the run could "
                       f"not see (check the keys file and the tenants' limits)")
    if findings.outcomes["ok"] and not findings.num_own_echoes:
        reasons.append(f"none of the {findings.outcomes['ok']} completed responses repeated its own marker: this "
                       f"run could not have seen a leak (raise --max-tokens)")
    reasons += _evidence_reasons(evidence)
    return reasons


def _evidence_reasons(evidence: dict[str, Any]) -> list[str]:
    if not evidence.get("available"):
        return []
    reasons = []
    violations = evidence.get("isolation_violations")
    if isinstance(violations, float) and violations > 0:
        reasons.append(f"the server tripped {violations:.0f} isolation checks")
    alloc = evidence.get("allocator_after_run")
    if isinstance(alloc, dict) and not alloc["is_idle"]:
        reasons.append(f"after the run the server still reports {alloc['pages_used']:.0f} pages used and "
                       f"{alloc['pages_free']:.0f} free (of {alloc['pages_total_before']} before the run)")
    return reasons


def preemptions(evidence: dict[str, Any]) -> dict[str, Any]:
    """Whether the server reported preemptions during the run: a count, or 'unknown' and why."""
    if not evidence.get("available"):
        return {"server_reported": "unknown", "why_unknown": evidence.get("reason")}
    count = evidence.get("preemptions")
    if not isinstance(count, float):
        return {"server_reported": "unknown", "why_unknown": "the server's /metrics has no kvseal_num_preemptions, "
                                                             "or it went down during the run (an engine restarted)"}
    return {"server_reported": count, "why_unknown": None}


def build_report(findings: Findings, evidence: dict[str, Any], run: dict[str, Any],
                 tenancy: dict[str, Any]) -> dict[str, Any]:
    reasons = verdict(findings, evidence, tenancy)
    return {
        "verdict": {"passed": not reasons, "reasons": reasons},
        "run": run,
        "tenancy": tenancy,
        "paths": paths(findings, run.get("tools_not_sent")),
        "preemption": {"pressure_requests": sum(r.request.is_pressure for r in findings.results),
                       **preemptions(evidence)},
        "requests_by_outcome": dict(sorted(findings.outcomes.items())),
        "oversized_prompts": findings.oversized,
        "own_marker_echoes": {"responses": findings.num_own_echoes, "of_completed": findings.outcomes["ok"],
                              "echo_requests_not_counted": sum(r.request.is_echo and r.outcome is Outcome.OK
                                                               for r in findings.results),
                              "tool_requests_not_counted": sum(r.request.is_tool_call and not r.request.is_echo
                                                               and r.outcome is Outcome.OK
                                                               for r in findings.results)},
        "leaks": [leak.as_dict() for leak in findings.leaks],
        "same_tenant_crossings": [leak.as_dict() for leak in findings.same_tenant_crossings],
        "num_server_errors": len(findings.server_errors),
        "server_errors": [_error_row(r) for r in findings.server_errors[:MAX_LISTED]],
        "refused": [_error_row(r) for r in findings.refused[:MAX_LISTED]],
        "unanswered": [_error_row(r) for r in findings.unanswered[:MAX_LISTED]],
        "server_evidence": evidence,
    }


def _error_row(r: RequestResult) -> dict[str, Any]:
    return {"request_id": r.request.request_id, "server_request_id": r.server_request_id, "tenant": r.request.tenant,
            "status": r.status, "error": r.error}


def write_report(report: dict[str, Any], path: str) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def summary_table(report: dict[str, Any]) -> str:
    """The human-readable summary printed at the end of a run."""
    rows: list[tuple[str, str]] = [("requests", str(report["run"]["num_requests"]))]
    rows += [(f"  {name}", str(n)) for name, n in report["requests_by_outcome"].items()]
    over = report["oversized_prompts"]
    rows.append(("oversized answered 4xx / 2xx / 5xx / other",
                 f"{over['4xx']} / {over['2xx']} / {over['5xx']} / {over['other']}"))
    echo = report["own_marker_echoes"]
    rows.append(("completed responses repeating their own marker",
                 f"{echo['responses']} of {echo['of_completed']} (echo requests not counted: "
                 f"{echo['echo_requests_not_counted']}, tool requests: {echo['tool_requests_not_counted']})"))
    several, logprobs = report["paths"]["n_gt_1"], report["paths"]["logprobs"]
    rows.append(("completed with n > 1 / all choices answered", f"{several['completed']} / "
                                                                 f"{several['with_every_choice']}"))
    rows.append(("completed with logprobs / tokens / top alternatives",
                 f"{logprobs['completed']} / {logprobs['with_tokens']} / {logprobs['with_top_alternatives']}"))
    prompt_logprobs, echoed = report["paths"]["prompt_logprobs"], report["paths"]["echo"]
    rows.append(("completed with prompt_logprobs / answered", f"{prompt_logprobs['completed']} / "
                                                               f"{prompt_logprobs['answered']}"))
    rows.append(("completed with echo / echoed", f"{echoed['completed']} / {echoed['answered']}"))
    rows.append(("completed with reasoning or tool calls (read when present)",
                 str(report["paths"]["reasoning_or_tool_calls"])))
    tools = report["paths"]["tool_calls"]
    rows.append(("tool calls asked / completed / with a call", f"not exercised: {tools['not_exercised']}"
                 if tools["not_exercised"] else f"{tools['asked']} / {tools['completed']} / {tools['with_call']}"))
    pre = report["preemption"]
    reported = pre["server_reported"]
    rows.append((f"preemptions the server reported (pressure requests: {pre['pressure_requests']})",
                 _fmt(reported) if reported != "unknown" else f"unknown: {pre['why_unknown']}"))
    rows.append(("5xx or stream errors", str(report["num_server_errors"])))
    rows.append(("tenancy: a made-up key", report["tenancy"]["open_door"] or "refused"))
    rows.append(("tenancy: prefix probe", probe_summary(report["tenancy"]["prefix_probe"])))
    rows.append(("foreign markers (leaks)", str(len(report["leaks"]))))
    rows += [(f"  {lk['request_id']} ({lk['tenant']}, server id {lk['server_request_id']})",
              f"holds {lk['foreign_request_id']}'s marker ({lk['foreign_tenant']}): {lk['matched']} "
              f"in {', '.join(lk['fields'])}")
             for lk in report["leaks"][:10]]
    rows.append(("same-tenant cross-request markers", str(len(report["same_tenant_crossings"]))))
    rows += _evidence_rows(report["server_evidence"])
    verdict_row = "PASS" if report["verdict"]["passed"] else "FAIL: " + "; ".join(report["verdict"]["reasons"])
    rows.append(("verdict", verdict_row))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _evidence_rows(evidence: dict[str, Any]) -> list[tuple[str, str]]:
    if not evidence.get("available"):
        return [("server evidence", f"unavailable: {evidence.get('reason')}")]
    alloc = evidence["allocator_after_run"]
    alloc_text = alloc if isinstance(alloc, str) else (
        f"{alloc['pages_used']:.0f} used, {alloc['pages_free']:.0f} free (before the run: "
        f"{alloc['pages_total_before']} in all)")
    return [
        ("server: requests by outcome (audit)", _fmt(evidence["requests_by_outcome"])),
        ("server: rejections by reason", _fmt(evidence["rejections_by_reason"])),
        ("server: isolation checks tripped", _fmt(evidence["isolation_violations"])),
        ("server: KV scrub mode", str(evidence.get("scrub_mode", "unavailable"))),
        ("server: pages scrubbed", _scrubbed_text(evidence)),
        ("server: allocator after the run", alloc_text),
    ]


def _scrubbed_text(evidence: dict[str, Any]) -> str:
    """The count, and why it is 0 where the server scrubs nothing (its default)."""
    scrubbed = _fmt(evidence["pages_scrubbed"])
    if evidence.get("scrub_mode") == "off":
        return f"{scrubbed} (scrub off: a freed page keeps its KV until its next owner overwrites it)"
    return scrubbed


def _fmt(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v:.0f}" for k, v in value.items()) or "none"
    if isinstance(value, float):
        return f"{value:.0f}"
    return str(value)
