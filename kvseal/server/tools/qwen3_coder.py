"""Qwen3-Coder's calls: `<tool_call>` blocks of `<function=NAME>` and `<parameter=KEY>` entries,
whose values are typed by the request's schemas (the package's docstring says how). A string's
`pattern` is checked on the shared event loop, within one request's bound (`patterns.py`: 50 ms
of checks in all); a pattern too costly to check is not held against a value."""

from __future__ import annotations

import ast
import json
import re
import warnings
from typing import Any

from kvseal.errors import InvalidParameter
from kvseal.server.tools.calls import (
    NOT_JSON,
    ParsedToolCall,
    arguments_json,
    before_partial,
    block_calls,
    is_utf8,
    openai_id,
)
from kvseal.server.tools.patterns import PatternChecks
from kvseal.server.tools.readers import BlockReader
from kvseal.types import StructuredOutput


class Qwen3CoderToolParser:
    arguments_key = "arguments"  # of the call schemas `forced_call` reads the tools from
    max_calls: int | None = None

    def __init__(self, parameters: dict[str, Any] | None = None, patterns: PatternChecks | None = None) -> None:
        """`parameters`: each tool's parameters schema by its name, which types the values.
        `patterns`: the checks of strings' patterns (their budget is one request's: a parser
        serves one request, whose streams' drafts and parses share them and so type a value alike)."""
        self._parameters = parameters or {}
        self._patterns = patterns if patterns is not None else PatternChecks()

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content outside the calls or None, the calls). A block that is not one whole
        `<function=...>` of parameters (cut off by max_tokens, or anything else) stays content."""
        return block_calls(text, self._read_call)

    def call_reader(self) -> BlockReader:
        return BlockReader(lambda: Qwen3CoderDraft(self._parameters, self._patterns), self._read_call)

    def new_call_id(self) -> str:
        return openai_id()

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
            arguments[key] = _typed(raw, properties.get(key) if isinstance(properties, dict) else None,
                                    self._patterns)
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


def _typed(raw: str, schema: Any, patterns: PatternChecks) -> Any:
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
    readings = [reading for reading in dict.fromkeys((text, raw, bare)) if _within_lengths(reading, schema)]
    pattern = schema.get("pattern")
    if not isinstance(pattern, str) or readings in ([], [text]):  # (no search could change the answer)
        return readings[0] if readings else text
    return next((reading for reading in readings if patterns.allows(pattern, reading)), text)


def _within_lengths(text: str, schema: dict[str, Any]) -> bool:
    """Whether `text` has the schema's minLength and maxLength (its pattern: `PatternChecks`)."""
    min_length, max_length = schema.get("minLength"), schema.get("maxLength")
    if isinstance(min_length, int) and len(text) < min_length:
        return False
    return not (isinstance(max_length, int) and len(text) > max_length)


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


_FUNCTION_TAG, _PARAMETER_TAG = "<function=", "<parameter="
_PARAMETER_END, _FUNCTION_END = "</parameter>", "</function>"


class Qwen3CoderDraft:
    """A `<tool_call>` block's body being written (`readers.BlockReader`): its name once its
    `<function=NAME>` has come, then each parameter once its value has ended (its
    `</parameter>`, or the next `<parameter=`), typed as the parser types it (`_typed`: by the
    whole value, so a value is sent whole). Anything but whitespace where the parser takes
    none stops it; a value cut by the function's end waits for the parser's reading."""

    def __init__(self, parameters: dict[str, Any], patterns: PatternChecks) -> None:
        self._parameters = parameters
        self._patterns = patterns
        self._state = "lead"  # lead, name, parameters, key, value, stopped
        self._tag = ""  # a tag being read (`<function=`, `<parameter=`)
        self._name: list[str] = []  # its characters, as the key's (a list: no copy per character)
        self._key: list[str] = []
        self._named = ""  # the name, once its `>` came
        self._keys: set[str] = set()
        self._value: list[str] = []  # the value's text so far, less `_tail`
        self._tail = ""  # the value's end that may begin a tag ending it
        self._fresh: list[str] = []  # arguments text not yet taken
        self._is_named = False

    @property
    def is_stopped(self) -> bool:
        return self._state == "stopped"

    @property
    def is_whole(self) -> bool:
        return False  # (its block's end tag ends it: the reader finds it)

    def feed(self, raw: str) -> int:
        rest, position = raw, 0
        while position < len(rest) and self._state != "stopped":
            if self._state == "value":
                rest, position = self._value_text(rest[position:]), 0
            else:
                self._state = self._next_state(rest[position])
                position += 1
        return len(raw)

    def take(self) -> tuple[str | None, str]:
        fresh, self._fresh = "".join(self._fresh), []
        return (self._named if self._is_named else None), fresh

    def _next_state(self, char: str) -> str:
        state = self._state
        if state in ("lead", "parameters") and not self._tag and char.isspace():
            return state
        if state in ("lead", "parameters"):
            return self._tag_char(char, _FUNCTION_TAG if state == "lead" else _PARAMETER_TAG)
        if char in "<\n" or (char == ">" and not (self._key if state == "key" else self._name)):
            return "stopped"
        if char != ">":
            (self._key if state == "key" else self._name).append(char)
            return state
        if state == "name":
            self._is_named = True
            self._named = "".join(self._name)
            self._fresh.append("{")
            return "parameters"
        self._value, self._tail = [], ""
        return "value"

    def _tag_char(self, char: str, tag: str) -> str:
        self._tag += char
        if not tag.startswith(self._tag):
            return "stopped"  # (after the parameters, `</function>`: nothing more to send)
        if self._tag != tag:
            return self._state
        self._tag, self._key = "", []
        return "name" if tag == _FUNCTION_TAG else "key"

    def _value_text(self, raw: str) -> str:
        """Read a value's text in `raw`; the text after the value when it ends there."""
        text = self._tail + raw
        ends = [(position, tag) for tag in (_PARAMETER_END, _PARAMETER_TAG) if (position := text.find(tag)) >= 0]
        if not ends:
            keep = min(before_partial(text, _PARAMETER_END), before_partial(text, _PARAMETER_TAG))
            self._value.append(text[:keep])
            self._tail = text[keep:]
            return ""
        position, tag = min(ends)
        self._value.append(text[:position])
        self._state = "parameters" if tag == _PARAMETER_END else "key"
        self._key_done("".join(self._value))
        return text[position + len(tag):]

    def _key_done(self, raw: str) -> None:
        """Send the parameter `_key` of value `raw`, typed as the parser types it."""
        key = "".join(self._key)
        schema = self._parameters.get(self._named)
        properties = schema.get("properties") if isinstance(schema, dict) else None
        value = _typed(raw, properties.get(key) if isinstance(properties, dict) else None, self._patterns)
        try:
            dumped = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except NOT_JSON:
            dumped = ""
        piece = f"{', ' if self._keys else ''}{json.dumps(key, ensure_ascii=False)}: {dumped}"
        if not dumped or key in self._keys or not is_utf8(piece):  # (a key twice: the parser keeps the last value)
            self._state = "stopped"
            return
        self._keys.add(key)
        self._key = []
        self._fresh.append(piece)
