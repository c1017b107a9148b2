"""Rows out as an aligned table, CSV or JSON (the formats `kvseal usage` and `kvseal audit` share).

The table is for a terminal: each cell shows its control characters as escapes (`visible`), so
one record is one line. CSV and JSON keep every value exact (CSV, with RFC 4180's CRLF rows,
quotes a value with a CR or LF in it, so a CSV reader sees one field).
"""

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


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def visible(text: str) -> str:
    """`text` with every character a terminal would act on or hide written as an escape: newline,
    CR and tab as `\\n`, `\\r`, `\\t`, other control and format characters (C0, DEL, C1, an ANSI
    escape's ESC, bidi overrides, line separators) as `\\xNN` or `\\uNNNN`, and a backslash
    as `\\\\`, so an escape always means one character. A table cell holds what clients sent
    (a refused request's model name): written raw, a newline in it would print a row of its own,
    and a tenant could forge a line naming another."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(_visible_char(ch) for ch in text)


def _visible_char(ch: str) -> str:
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    if ch.isprintable():
        return ch
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def table(rows: Sequence[dict[str, object]], columns: Sequence[str]) -> str:
    """Left-aligned columns under a header, every cell `visible`; '(none)' for no rows."""
    if not rows:
        return "(none)\n"
    cells = [[visible(cell(row.get(c))) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(text.ljust(w) for text, w in zip(line, widths)).rstrip() for line in [list(columns), *cells]]
    return "\n".join(lines) + "\n"


def csv_text(rows: Sequence[dict[str, object]], columns: Sequence[str]) -> str:
    """RFC 4180's CSV, rows ended by CRLF: the csv module quotes a value holding any character of
    the line terminator, so with CRLF a value with a lone CR (or LF) in it is quoted, and a
    reader sees one field where a client's text put a line break."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(columns)
    writer.writerows([cell(row.get(c)) for c in columns] for row in rows)
    return out.getvalue()


def json_text(value: object) -> str:
    return json.dumps(value, indent=2) + "\n"
