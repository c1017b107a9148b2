"""JSON Schemas for the grammar-compile tests, each within the door's size limit (64K characters).

- `SLOW_SCHEMA`: 2,000 optional properties. xgrammar's compile grows steeply with optional
  properties: about 20 s on the character-level tiny model's vocabulary on an idle core (1,000
  take about 2 s), so it always runs over the test pools' and servers' budgets (4 and 6 s).
- `BIG_SCHEMA`: 1,600 required properties, about 60K characters: huge but quick (~0.14 s on an
  idle core, ~1.5 s at the workers' lower CPU priority on a core another process keeps busy),
  so it is always within the budget.
- `SMALL_SCHEMA`: what another tenant sends meanwhile (milliseconds); `small_schema()` makes a
  new one each time, `big_schema()` too (a tenant's compiled grammars are cached: a repeated
  one would not compile at all).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from kvseal.structured.schema import MAX_SCHEMA_CHARS
from kvseal.types import StructuredOutput

SLOW_SCHEMA: dict[str, Any] = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
BIG_SCHEMA: dict[str, Any] = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1600)},
                              "required": [f"p{i}" for i in range(1600)]}
SMALL_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                "additionalProperties": False}
assert all(len(json.dumps(s)) <= MAX_SCHEMA_CHARS for s in (SLOW_SCHEMA, BIG_SCHEMA)), "within the door's limit"


def spec(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))

_ids = itertools.count()


def small_schema() -> dict[str, Any]:
    """`SMALL_SCHEMA` under a new title: a grammar no tenant has compiled yet."""
    return SMALL_SCHEMA | {"title": f"small-{next(_ids)}"}


def big_schema() -> dict[str, Any]:
    """`BIG_SCHEMA` under a new title (a compiled one is cached for its tenant)."""
    return BIG_SCHEMA | {"title": f"big-{next(_ids)}"}
