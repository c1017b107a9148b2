"""Validating a JSON Schema before a request is admitted (no tokenizer needed)."""

from __future__ import annotations

import re

from kvseal.errors import InvalidParameter

MAX_SCHEMA_CHARS = 64 * 1024

_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:123: " prefix


def check_schema(schema_json: str) -> None:
    """Raise `InvalidParameter` (param response_format) naming what xgrammar cannot turn into a
    grammar: bad JSON Schema, or a feature it does not support. Pure; may take a while on a
    big schema, so callers run it off the event loop."""
    if len(schema_json) > MAX_SCHEMA_CHARS:
        raise InvalidParameter(f"the JSON schema has {len(schema_json)} characters; the limit is "
                               f"{MAX_SCHEMA_CHARS}. Send a smaller schema.", param="response_format")
    import xgrammar

    try:
        xgrammar.Grammar.from_json_schema(schema_json)
    except (RuntimeError, ValueError) as exc:
        raise InvalidParameter(f"invalid JSON schema in response_format: {describe_error(exc)}",
                               param="response_format") from None


def describe_error(exc: Exception) -> str:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _LOG_PREFIX.sub("", first_line)
