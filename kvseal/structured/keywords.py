"""The JSON Schema keywords a grammar cannot enforce while sampling, refused rather than dropped.

xgrammar turns a JSON Schema into a grammar, and some keywords do not survive: it compiles the
schema without them (`uniqueItems`, `if`, `dependentRequired`, ...), or into a
grammar that does not mean the same (`not` is dropped; `contains` allows only the empty array;
`allOf` over several schemas accepts anything but an integer). A request whose schema says one of
those would get output that breaks its schema with a 200, so a schema that uses one is refused,
naming the keyword and where it is. vLLM refuses most of the same with its xgrammar backend.
`tests/engine/test_structured.py` shows, against the xgrammar this project pins, that for each
keyword here the grammar and a JSON Schema validator disagree on an instance.

Annotations (`title`, `description`, `default`, `examples`, ...) constrain nothing and pass, as
does a `format` xgrammar has no pattern for (`password`, `binary`, ...: JSON Schema makes `format`
an annotation unless a validator knows it; xgrammar enforces email, date, time, date-time,
duration, uri, uuid, ipv4, ipv6, hostname and a few more).
Pure: no xgrammar import, so the door and the grammar workers both use it.
"""

from __future__ import annotations

import json
from typing import Any

UNENFORCED = frozenset({"not", "if", "contains", "minContains", "maxContains", "dependentRequired",
                        "dependentSchemas", "dependencies"})
_SCHEMA_VALUED = ("items", "additionalProperties", "propertyNames", "contains", "not", "if", "then", "else",
                  "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def unenforced_keyword(schema_json: str) -> str | None:
    """What of the schema a grammar would not enforce ("'uniqueItems' at /items"), or None."""
    try:
        schema = json.loads(schema_json)
    except ValueError:
        return None  # the compiler reports what is wrong with it
    return _first_unenforced(schema, "")


def _first_unenforced(schema: Any, where: str) -> str | None:
    if not isinstance(schema, dict):
        return None
    at = where or "the top"
    for key, value in schema.items():
        if key in UNENFORCED or (key == "uniqueItems" and value is not False):
            return f"'{key}' at {at}"
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            return f"'allOf' over {len(value)} schemas at {at} (merge them into one)"
    return _first_in_subschemas(schema, where)


def _first_in_subschemas(schema: dict[str, Any], where: str) -> str | None:
    for key in _SCHEMA_VALUED:
        if isinstance(schema.get(key), dict) and (found := _first_unenforced(schema[key], f"{where}/{key}")):
            return found
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, part in enumerate(schema[key]):
                if found := _first_unenforced(part, f"{where}/{key}/{i}"):
                    return found
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, part in schema[key].items():
                if found := _first_unenforced(part, f"{where}/{key}/{name}"):
                    return found
    return None
