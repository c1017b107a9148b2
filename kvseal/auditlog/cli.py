"""`kvseal usage` and `kvseal audit`: their flags and what they print."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvseal.auditlog.files import AuditLogError, AuditLogReader, TimeWindow, iso
from kvseal.auditlog.output import FORMATS, csv_text, json_text, table
from kvseal.auditlog.query import Affected, Predicate, engines_of, matching
from kvseal.auditlog.record import LoggedRequest
from kvseal.auditlog.usage import COUNT_FIELDS, usage_rows, usage_totals
from kvseal.server.audit import Outcome

WINDOW_HELP = "Unix seconds or ISO 8601 (2026-12-05T06:00:00Z; a time without a zone is UTC)"


def add_auditlog_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    usage = sub.add_parser("usage", help="per-tenant (or per-key) requests and tokens from the audit log, for billing")
    _add_common(usage, default_format="table")
    usage.add_argument("--by", choices=("tenant", "key"), default="tenant",
                       help="one row per tenant (default), or per tenant and API key id")
    usage.set_defaults(func=cmd_usage)

    audit = sub.add_parser("audit", help="which requests, of which tenants, in a time window: the audit log's "
                                         "answers to an incident's questions (--affected)")
    _add_common(audit, default_format="table")
    _add_predicate(audit)
    audit.add_argument("--affected", action="store_true",
                       help="the requests in the window (--since and --until, both needed) that match and handed "
                            "their client generated text, and their tenants with counts")
    audit.set_defaults(func=cmd_audit)


def _add_common(parser: argparse.ArgumentParser, default_format: str) -> None:
    parser.add_argument("--audit-log", required=True, metavar="FILE",
                        help="the file kvseal serve --audit-log wrote; its rotated files FILE.N and logrotate's "
                             "FILE-DATE (and their .gz) are read too, oldest first")
    parser.add_argument("--since", help=f"from this time (included): {WINDOW_HELP}")
    parser.add_argument("--until", help=f"to this time (excluded): {WINDOW_HELP}")
    parser.add_argument("--format", choices=FORMATS, default=default_format, help="output format")


def _add_predicate(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("filters (flags of different names must all hold; a flag given twice "
                                      "means either value)")
    for name, what in (("tenant", "the tenant"), ("key-id", "the API key id (kvseal usage --by key)"),
                       ("model", "the model the request named"),
                       ("engine", "an engine that handled it: engine-PID (colocated) or a PD prefill or decode "
                                  "instance id"),
                       ("endpoint", "the endpoint, e.g. /v1/chat/completions"), ("reason", "the reason code "
                        "(a rejection's, an abort's, an error's or an isolation check's)"),
                       ("request-id", "the request id (the x-request-id response header)")):
        group.add_argument(f"--{name}", action="append", default=[], help=what)
    group.add_argument("--outcome", action="append", default=[], choices=OUTCOMES, help="how the request ended")
    group.add_argument("--min-prompt-tokens", type=int, help="prompts of at least this many tokens")
    group.add_argument("--max-prompt-tokens", type=int, help="prompts of at most this many tokens")
    group.add_argument("--isolation-events", action="store_true",
                       help="only requests an isolation check ended (outcome isolation_violation)")


OUTCOMES: tuple[Outcome, ...] = ("finished", "rejected", "aborted", "error", "isolation_violation")
COLUMNS = ("received_at", "request_id", "tenant", "outcome", "reason", "prompt_tokens", "output_tokens",
           "engines", "model", "endpoint")


def _predicate(ns: argparse.Namespace) -> Predicate:
    for name in ("min_prompt_tokens", "max_prompt_tokens"):
        if getattr(ns, name) is not None and getattr(ns, name) < 0:
            raise AuditLogError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(ns, name)}")
    return Predicate(tuple(ns.tenant), tuple(ns.key_id), tuple(ns.model), tuple(ns.engine), tuple(ns.endpoint),
                     tuple(ns.outcome), tuple(ns.reason), tuple(ns.request_id), ns.min_prompt_tokens,
                     ns.max_prompt_tokens, ns.isolation_events)


def _row(r: LoggedRequest) -> dict[str, object]:
    """A request for the table and CSV: times in ISO 8601 (UTC), the engines in one column."""
    return {**r.to_dict(), "received_at": iso(r.received_at), "finished_at": iso(r.finished_at),
            "engines": engines_of(r)}


def cmd_audit(ns: argparse.Namespace) -> int:
    window, predicate = TimeWindow.parse(ns.since, ns.until), _predicate(ns)
    if ns.affected and not window.is_bounded:
        raise AuditLogError("--affected needs a window: give --since and --until (when the fault began and "
                            "ended)")
    reader = open_log(Path(ns.audit_log))
    found = matching(reader.records(), window, predicate)
    # the operator's actions in the window (a key revoked, the model disabled): when a fault was
    # stopped is part of an incident's answer
    actions = [a for a in reader.admin_actions if isinstance(a.get("at"), int | float) and window.holds(a["at"])]
    summary: dict[str, object] = {"window": {"since": window.since, "until": window.until},
                                  "predicate": predicate.describe(),
                                  "files": [str(f) for f in reader.files], "admin_actions": actions}
    if ns.affected:
        _print_affected(Affected.among(found), window, predicate, summary, ns.format)
    else:
        _print_requests(found, window, predicate, summary, ns.format)
    _print_admin_actions(actions, ns.format)
    warn_skipped(reader)
    return 0


ADMIN_COLUMNS = ("at", "admin_action", "trigger", "by_tenant", "model", "num_aborted", "reason")


def _print_admin_actions(actions: list[dict[str, Any]], fmt: str) -> None:
    """After the requests, in a table, the operator's actions in the window (JSON has them in
    its object; CSV, one table per file, names their count on stderr)."""
    if not actions or fmt == "json":
        return
    if fmt == "csv":
        print(f"kvseal: {len(actions)} admin action(s) in the window (see --format table or json)", file=sys.stderr)
        return
    rows = [{c: iso(a["at"]) if c == "at" else a.get(c, "") for c in ADMIN_COLUMNS} for a in actions]
    sys.stdout.write("\n" + table(rows, ADMIN_COLUMNS))
    print(f"{len(actions)} admin action(s) in the window")


def _print_requests(found: list[LoggedRequest], window: TimeWindow, predicate: Predicate,
                    summary: dict[str, object], fmt: str) -> None:
    if fmt == "json":
        sys.stdout.write(json_text({**summary, "num_requests": len(found), "requests": [r.to_dict() for r in found]}))
    elif fmt == "csv":
        sys.stdout.write(csv_text([_row(r) for r in found], COLUMNS))
    else:
        sys.stdout.write(table([_row(r) for r in found], COLUMNS))
        print(f"{len(found)} requests in flight during {window.describe()} matching {predicate.describe()}")


def _print_affected(affected: Affected, window: TimeWindow, predicate: Predicate, summary: dict[str, object],
                    fmt: str) -> None:
    line = (f"{len(affected.requests)} requests of {len(affected.num_by_tenant)} tenants could have been affected: "
            f"in flight during {window.describe()}, matching {predicate.describe()}, answered with generated text")
    if fmt == "json":
        sys.stdout.write(json_text({**summary, "num_requests": len(affected.requests),
                                    "num_tenants": len(affected.num_by_tenant), "tenants": affected.num_by_tenant,
                                    "requests": [r.to_dict() for r in affected.requests]}))
        return
    if fmt == "csv":
        sys.stdout.write(csv_text([_row(r) for r in affected.requests], COLUMNS))
        print(line, file=sys.stderr)
        return
    sys.stdout.write(table([_row(r) for r in affected.requests], COLUMNS) + "\n")
    sys.stdout.write(table([{"tenant": t, "requests": n} for t, n in affected.num_by_tenant.items()],
                           ("tenant", "requests")))
    print(line)


def cmd_usage(ns: argparse.Namespace) -> int:
    window = TimeWindow.parse(ns.since, ns.until)
    reader = open_log(Path(ns.audit_log))
    rows = usage_rows(usage_totals(reader.records(), window, ns.by), ns.by)
    columns = ["tenant", *(["key_id"] if ns.by == "key" else []), *COUNT_FIELDS, "rejections"]
    if ns.format == "json":
        sys.stdout.write(json_text({"window": {"since": window.since, "until": window.until},
                                    "files": [str(f) for f in reader.files], "by": ns.by, "rows": rows}))
    else:
        sys.stdout.write((table if ns.format == "table" else csv_text)(rows, columns))
    warn_skipped(reader)
    return 0


def open_log(path: Path) -> AuditLogReader:
    """The reader of the log at `path`, its warnings about the files chosen said first: they
    hold even if reading then fails."""
    reader = AuditLogReader(path)
    for warning in reader.warnings:
        print(f"kvseal: warning: {warning}", file=sys.stderr)
    return reader


def warn_skipped(reader: AuditLogReader) -> None:
    if reader.num_skipped:
        print(f"kvseal: warning: skipped {reader.num_skipped} line(s) that are not audit records; the first: "
              f"{reader.first_skipped}", file=sys.stderr)
