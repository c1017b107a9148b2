"""Rows out as an aligned table, CSV or JSON (the formats `kvseal usage` and `kvseal audit` share)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from typing import Literal

Format = Literal["table", "csv", "json"]
FORMATS = ("table", "csv", "json")


def cell(value: object) -> str:
    """A value as one table or CSV cell: mappings as `key=value;...`, lists joined by ','."""
    if value is None:
        return ""
    if isinstance(value, dict):
        return ";".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def table(rows: Sequence[dict[str, object]], columns: Sequence[str]) -> str:
    """Left-aligned columns under a header; '(none)' for no rows."""
    if not rows:
        return "(none)\n"
    cells = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(text.ljust(w) for text, w in zip(line, widths)).rstrip() for line in [list(columns), *cells]]
    return "\n".join(lines) + "\n"


def csv_text(rows: Sequence[dict[str, object]], columns: Sequence[str]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows([cell(row.get(c)) for c in columns] for row in rows)
    return out.getvalue()


def json_text(value: object) -> str:
    return json.dumps(value, indent=2) + "\n"
