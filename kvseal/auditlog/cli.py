"""`kvseal usage` and `kvseal audit`: their flags and what they print."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvseal.auditlog.files import AuditLogReader, TimeWindow
from kvseal.auditlog.output import FORMATS, csv_text, json_text, table
from kvseal.auditlog.usage import COUNT_FIELDS, usage_rows, usage_totals

WINDOW_HELP = "Unix seconds or ISO 8601 (2026-12-05T06:00:00Z; a time without a zone is UTC)"


def add_auditlog_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    usage = sub.add_parser("usage", help="per-tenant (or per-key) requests and tokens from the audit log, for billing")
    _add_common(usage, default_format="table")
    usage.add_argument("--by", choices=("tenant", "key"), default="tenant",
                       help="one row per tenant (default), or per tenant and API key id")
    usage.set_defaults(func=cmd_usage)


def _add_common(parser: argparse.ArgumentParser, default_format: str) -> None:
    parser.add_argument("--audit-log", required=True, metavar="FILE",
                        help="the file kvseal serve --audit-log wrote; its rotated files FILE.N (and FILE.N.gz) "
                             "are read too, oldest first")
    parser.add_argument("--since", help=f"from this time (included): {WINDOW_HELP}")
    parser.add_argument("--until", help=f"to this time (excluded): {WINDOW_HELP}")
    parser.add_argument("--format", choices=FORMATS, default=default_format, help="output format")


def cmd_usage(ns: argparse.Namespace) -> int:
    window = TimeWindow.parse(ns.since, ns.until)
    reader = AuditLogReader(Path(ns.audit_log))
    rows = usage_rows(usage_totals(reader.records(), window, ns.by), ns.by)
    columns = ["tenant", *(["key_id"] if ns.by == "key" else []), *COUNT_FIELDS, "rejections"]
    if ns.format == "json":
        sys.stdout.write(json_text({"window": {"since": window.since, "until": window.until},
                                    "files": [str(f) for f in reader.files], "by": ns.by, "rows": rows}))
    else:
        sys.stdout.write((table if ns.format == "table" else csv_text)(rows, columns))
    warn_skipped(reader)
    return 0


def warn_skipped(reader: AuditLogReader) -> None:
    if reader.num_skipped:
        print(f"kvseal: warning: skipped {reader.num_skipped} line(s) that are not audit records; the first: "
              f"{reader.first_skipped}", file=sys.stderr)
