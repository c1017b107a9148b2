"""Qwen3-Coder's calls: `<tool_call>` blocks of `<function=NAME>` and `<parameter=KEY>` entries,
whose values are typed by the request's schemas (the package's docstring says how)."""

from __future__ import annotations

import ast
import json
import re
import warnings
from typing import Any

from kvseal.errors import InvalidParameter
from kvseal.server.tools.calls import NOT_JSON, ParsedToolCall, arguments_json, block_calls, held_from_start_tag
from kvseal.types import StructuredOutput


class Qwen3CoderToolParser:
    arguments_key = "arguments"  # of the call schemas `forced_call` reads the tools from
    streams_arguments = False
    max_calls: int | None = None

    def __init__(self, parameters: dict[str, Any] | None = None) -> None:
        """`parameters`: each tool's parameters schema by its name, which types the values."""
        self._parameters = parameters or {}

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content outside the calls or None, the calls). A block that is not one whole
        `<function=...>` of parameters (cut off by max_tokens, or anything else) stays content."""
        return block_calls(text, self._read_call)

    def held_from(self, text: str) -> int:
        return held_from_start_tag(text)

    def forced_call(self, call_schemas: list[dict[str, Any]], is_parallel: bool = False) -> StructuredOutput:
        """One block in this format, for one of the tools, parallel or not (xgrammar's structural
        tag, in `structured/grammars.py`)."""
        tools = [{"name": schema["properties"]["name"]["const"], "parameters": schema["properties"][self.arguments_key]}
                 for schema in call_schemas]
        for tool in tools:
            properties = tool["parameters"].get("properties")
            for key in properties if isinstance(properties, dict) else []:
                if _QWEN_UNWRITABLE.search(key):
                    raise InvalidParameter(
                        f"tool {tool['name']!r} has a parameter named {key!r}: qwen3_coder writes a parameter's "
                        f"name inside <parameter=...>, which cannot hold '<', '>' or a line break, so an enforced "
                        f"call (tool_choice required or named) could not name it; rename the parameter",
                        param="tools")
        return StructuredOutput("qwen3_coder_call", json.dumps(tools))

    def _read_call(self, body: str) -> ParsedToolCall | None:
        """The call of one block's body, `<function=NAME>` then parameters then `</function>`;
        None when it is anything else."""
        function = _QWEN_FUNCTION.fullmatch(body)
        if function is None:
            return None
        name, inner = function.groups()
        schema = self._parameters.get(name)
        properties = schema.get("properties") if isinstance(schema, dict) else None
        arguments, position = {}, 0
        while (parameter := _QWEN_PARAMETER.match(inner, position)) is not None:
            key, raw = parameter.groups()
            arguments[key] = _typed(raw, properties.get(key) if isinstance(properties, dict) else None)
            position = parameter.end()
        if inner[position:].strip():
            return None  # text between the parameters: not this format
        text = arguments_json(arguments)
        return None if text is None else ParsedToolCall(name, text)


# A Qwen3-Coder block's body, and one parameter in it: its end tag may be missing before the next
# parameter or the function's end, as vLLM's parser reads it
_QWEN_FUNCTION = re.compile(r"<function=([^<>\n]+)>(.*)</function>", re.DOTALL)
_QWEN_PARAMETER = re.compile(r"\s*<parameter=([^<>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_QWEN_UNWRITABLE = re.compile(r"[<>\n]")  # what a parameter's name in <parameter=NAME> cannot hold
_UNREAD = object()  # a value not of the type tried


def _typed(raw: str, schema: Any) -> Any:
    """A Qwen3-Coder parameter's value by its schema, from the `raw` text between its tags: the
    `const` or one of the `enum` values its text spells, else the first of its declared types
    (`type`, or those of `anyOf` / `oneOf`) other than string that the text reads as, else the
    text itself (a string parameter, one without a schema, or a value that is not of its type:
    the client sees what the model wrote), less the template's newline at each end."""
    text = raw.removeprefix("\n").removesuffix("\n")  # the template's newlines around it
    if not isinstance(schema, dict):
        return text
    bare = text.strip()
    members = [schema["const"]] if "const" in schema else schema.get("enum")
    for member in members if isinstance(members, list) else []:
        if bare == (member if isinstance(member, str) else json.dumps(member, ensure_ascii=False)):
            return member
    for kind in _declared_types(schema):
        value = _read_as(kind, bare)
        if value is not _UNREAD:
            return value
    if not _STRING_BOUNDS.intersection(schema):
        return text
    # A string held to a length or a pattern: the enforced call's grammar (xgrammar's `qwen_xml`)
    # counts every character between the tags, newlines and the whitespace it lets in included,
    # so the reading the bounds hold for is the one it enforced: the template's, else the raw
    # text, else the text without the whitespace around it.
    return next((reading for reading in (text, raw, bare) if _within_string_bounds(reading, schema)), text)


def _within_string_bounds(text: str, schema: dict[str, Any]) -> bool:
    """Whether `text` has the schema's minLength, maxLength and pattern (searched, as JSON Schema
    does; a pattern Python's re cannot read is not held against it)."""
    min_length, max_length, pattern = schema.get("minLength"), schema.get("maxLength"), schema.get("pattern")
    if isinstance(min_length, int) and len(text) < min_length:
        return False
    if isinstance(max_length, int) and len(text) > max_length:
        return False
    if isinstance(pattern, str):
        try:
            return re.search(pattern, text) is not None
        except re.error:
            return True
    return True


_STRING_BOUNDS = frozenset({"pattern", "format", "minLength", "maxLength"})


def _declared_types(schema: dict[str, Any]) -> list[str]:
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [kind for kind in declared if isinstance(kind, str)]
    parts = [part for key in ("anyOf", "oneOf") if isinstance(schema.get(key), list) for part in schema[key]]
    return [kind for part in parts if isinstance(part, dict) for kind in _declared_types(part)]


def _read_as(kind: str, text: str) -> Any:
    """`text` as a value of JSON Schema type `kind`; `_UNREAD` when it is none (or `kind` is
    string, which any text is)."""
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _UNREAD)
    if kind == "null":
        return None if text.lower() in ("null", "none") else _UNREAD  # (the template writes Python's None)
    if kind in ("integer", "number"):
        value = _json_value(text)
        is_number = isinstance(value, int) if kind == "integer" else isinstance(value, int | float)
        return value if is_number and not isinstance(value, bool) else _UNREAD
    if kind in ("object", "array"):
        wanted = dict if kind == "object" else list
        value = _json_value(text)
        if not isinstance(value, wanted):
            value = _python_literal(text)
        return value if isinstance(value, wanted) and _is_json(value) else _UNREAD
    return _UNREAD


def _json_value(text: str) -> Any:
    """The JSON value `text` is (NaN and Infinity, which strict JSON has not, refused), or `_UNREAD`."""
    def refuse(constant: str) -> Any:
        raise ValueError(constant)

    try:
        return json.loads(text, parse_constant=refuse)
    except NOT_JSON:
        return _UNREAD


def _is_json(value: Any) -> bool:
    """Whether strict JSON has `value` (a Python literal may hold a set, bytes, a complex number)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def _python_literal(text: str) -> Any:
    """The Python literal `text` is (`{'a': True}`: a model may write its object so), or `_UNREAD`.
    Only parsed, never evaluated (`ast.literal_eval`)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _UNREAD
