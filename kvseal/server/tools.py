"""Function calling on chat completions: `tools`, `tool_choice`, and the call parsers.

The tool definitions go to the model's own chat template (`apply_chat_template(tools=...)`).
The model answers in its family's format, which the parser `--tool-call-parser` names turns
into OpenAI's `tool_calls` (as vLLM's parser of that name does); without the flag a request
with tools is refused:
- `hermes` (Hermes, Qwen): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  blocks anywhere in the text (`HermesToolParser`).
- `llama3_json` (Llama 3.1 to 3.3): an answer that is one or more `{"name": ...,
  "parameters": {...}}` objects (or `"arguments"`), separated by `;`, optionally after
  `<|python_tag|>` (`Llama3JsonToolParser`); an answer that does not begin so is content.
- `mistral` (Mistral's instruct models from v0.3): an answer that is a JSON list of `{"name":
  ..., "arguments": {...}}` objects after `[TOOL_CALLS]` (a special token, so usually not in
  the text) (`MistralToolParser`); its call ids are nine letters and digits, the only ids
  Mistral's chat templates take back in the history.
- `pythonic` (Llama 3.2 and 4, and models tuned on the same format): an answer that is a Python
  list of calls with keyword arguments of literal values, `[get_weather(city="Oslo"),
  get_time(zone="CET")]`, optionally between Llama 4's `<|python_start|>` and `<|python_end|>`
  (`PythonicToolParser`). It is read with Python's parser, never run.
- `qwen3_coder` (Qwen3-Coder): `<tool_call>` blocks anywhere in the text, each one
  `<function=NAME>` of `<parameter=KEY>\\nVALUE\\n</parameter>` entries (`Qwen3CoderToolParser`).
  A value is raw text, typed by the request's schema for that parameter as vLLM's parser types
  it: a string stays the text (less the template's newline at each end); an `enum` or
  `const` value is the one its text spells; an integer, number, boolean, null, object or array
  is read as JSON (`True` and `None` too, which the template writes for Python's values; an
  object or array also as a Python literal, never run); a value that is not of its type, or of
  a parameter or tool the request does not define, stays text. A block that is not one whole
  function of parameters (cut off by max_tokens, two functions, stray text between parameters)
  is content, as hermes takes its blocks; unlike vLLM's parser, which reads a cut call as far
  as it goes and drops the text between and after calls. A string held to a length or a
  pattern is read as the text those bounds hold for (the enforced call's grammar counts the
  newlines and whitespace between the tags). The format cannot tell its own tags inside a
  value from the value's end: a string holding `</parameter>`, `<parameter=`, `</function>` or
  `</tool_call>` is cut there, as in vLLM's parser (a call so cut may come back as content).
  An enforced call's tools may not name a parameter with `<`, `>` or a line break.
In every format a call has a string name and an object of arguments under the format's key;
anything else (a JSON record that happens to have a `name`, a call with a positional argument or
a value that is not a literal) leaves the whole answer content, as in vLLM's parsers. A call
naming a function that is not in `tools` is still a call, as vLLM's parsers return it: the
client sees the name it got.
`tool_choice`:
- "auto" (the default with tools): the model may call tools; calls are parsed from its text
  (with `parallel_tool_calls: false`, the first call only, as vLLM keeps it).
- "none": tools are rendered but nothing is parsed; the text is the answer.
- "required": one or more calls (one with `parallel_tool_calls: false`), in the parser's format,
  are enforced with the grammar (each call's JSON must match one tool's parameters schema), then
  parsed, as vLLM's grammar of a list of at least one call allows; `llama3_json`'s and
  `qwen3_coder`'s enforced grammar holds one call, their formats' several calls being no one
  grammar value here (one call is still an answer vLLM's would allow).
- a named function: one call, to it, enforced and parsed likewise.
  `pythonic` has no JSON call of its own: its enforced calls are a JSON list of `{"name": ...,
  "arguments": {...}}` objects, as vLLM enforces every format's, which its parser also reads.
  `qwen3_coder`'s is one block in its own XML form (xgrammar's structural tag).
Streamed, a hermes call is sent as it is written (`ToolCallStream`): its name, then its arguments
in pieces; the other formats' calls are sent whole when the choice ends (their text is a call
only once the whole answer is read: llama3_json, mistral, pythonic; or its values are typed by
the whole of each: qwen3_coder).
"""

from __future__ import annotations

import ast
import bisect
import dataclasses
import json
import os
import re
import secrets
import string
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvseal.errors import InvalidParameter
from kvseal.server.config import TOOL_CALL_PARSERS
from kvseal.server.protocol import ChatCompletionRequest, NamedToolChoice, ToolDef
from kvseal.types import StructuredOutput

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
START_TAG, END_TAG = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
# what json raises for text that is no JSON value: RecursionError for brackets nested past its
# depth, which a model can write (and a tenant's regex make it write)
_NOT_JSON = (ValueError, RecursionError)


def _openai_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _mistral_id() -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=_openai_id)

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index} | call


class ToolParser(Protocol):
    arguments_key: str  # the key of a call's arguments in its JSON object, in this format
    streams_arguments: bool  # a stream sends a call's arguments as they come (`ToolCallStream`)
    max_calls: int | None  # the most calls `parse` returns (None: all)

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content outside the calls, or None when there is none besides calls; the calls)."""
        ...

    def held_from(self, text: str) -> int:
        """Where a call may begin in `text` so far: a stream shows the text before it as content
        and holds the rest until the choice ends (len(text): nothing to hold)."""
        ...

    def forced_call(self, call_schemas: list[dict[str, Any]], is_parallel: bool = False) -> StructuredOutput:
        """The grammar of one call in this format, its JSON one of `call_schemas` (`call_schema`'s,
        with this format's arguments key); with `is_parallel`, of one or more calls where the
        format can hold several (hermes, mistral, pythonic: tool_choice required, as vLLM's list
        of at least one call), one where it cannot (llama3_json, qwen3_coder)."""
        ...


class HermesToolParser:
    arguments_key = "arguments"
    streams_arguments = True
    max_calls: int | None = None

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content outside the calls or None, the calls). A block that is not a JSON object with
        a string `name` is left in the content, as text, rather than guessed at."""
        return _block_calls(text, _parse_call)

    def held_from(self, text: str) -> int:
        return _held_from_start_tag(text)

    def forced_call(self, call_schemas: list[dict[str, Any]], is_parallel: bool = False) -> StructuredOutput:
        return StructuredOutput("tool_calls" if is_parallel else "tool_call", json.dumps(_one_of(call_schemas)))


class Llama3JsonToolParser:
    arguments_key = "parameters"
    streams_arguments = False
    max_calls: int | None = None

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """All calls, or none: an answer that is not wholly calls (after `<|python_tag|>`,
        separated by `;`) is content, as it is, rather than guessed at."""
        body = text.strip().removeprefix(PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            try:
                value, position = decoder.raw_decode(body, position)
            except _NOT_JSON:
                return text, []
            call = _call_of(value, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            while position < len(body) and (body[position].isspace() or body[position] == ";"):
                position += 1
        return None, calls

    def held_from(self, text: str) -> int:
        return _held_while_calls_may_begin(text, "{", PYTHON_TAG)

    def forced_call(self, call_schemas: list[dict[str, Any]], is_parallel: bool = False) -> StructuredOutput:
        """One call, parallel or not: the JSON grammar holds one value (calls joined by `;` are
        no JSON value)."""
        return StructuredOutput("json_schema", json.dumps(_one_of(call_schemas)))


class MistralToolParser:
    arguments_key = "arguments"
    streams_arguments = False
    max_calls: int | None = None

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """All calls, or none: an answer that is not one JSON list of calls (after
        `[TOOL_CALLS]`) is content, as it is."""
        body = text.strip().removeprefix(MISTRAL_CALLS).lstrip()
        if not body.startswith("["):
            return text, []
        try:
            values = json.loads(body)
        except _NOT_JSON:
            return text, []
        calls = []
        for value in values:  # (a list: the text began with "[")
            call = _call_of(value, ("arguments",), _mistral_id())
            if call is None:
                return text, []
            calls.append(call)
        return (None, calls) if calls else (text, [])

    def held_from(self, text: str) -> int:
        return _held_while_calls_may_begin(text, "[", MISTRAL_CALLS)

    def forced_call(self, call_schemas: list[dict[str, Any]], is_parallel: bool = False) -> StructuredOutput:
        """A list of one call, or of one or more with `is_parallel` (the `[TOOL_CALLS]` token
        before it is special: no grammar writes it, and the parser does without it)."""
        return _list_of_calls(call_schemas, is_parallel)


class PythonicToolParser:
    arguments_key = "arguments"  # of the enforced call's JSON (`forced_call`)
    streams_arguments = False
    max_calls: int | None = None

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """All calls, or none: an answer that is not wholly one list of calls (or the enforced
        call's JSON list) is content, as it is."""
        body = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
        if not body.startswith("["):
            return text, []
        calls = _json_calls(body)
        if calls is None:
            calls = _python_calls(body)
        return (None, calls) if calls else (text, [])

    def held_from(self, text: str) -> int:
        return _held_while_calls_may_begin(text, "[", PYTHON_START)

    def forced_call(self, call_schemas: list[dict[str, Any]], is_parallel: bool = False) -> StructuredOutput:
        """A JSON list of one call (one or more with `is_parallel`): a Python call's arguments have
        no schema a grammar could hold them to, a JSON object's do."""
        return _list_of_calls(call_schemas, is_parallel)


def _block_calls(text: str, read: Callable[[str], ParsedToolCall | None]) -> tuple[str | None, list[ParsedToolCall]]:
    """`parse` of a format whose calls are `<tool_call>` blocks anywhere in the text: (the text
    outside the calls or None, the calls); a block `read` makes no call of (None) is left in
    the content, as text."""
    calls, kept = [], []
    position = 0
    for match in _CALL.finditer(text):
        call = read(match.group(1))
        if call is None:
            continue
        kept.append(text[position:match.start()])
        position = match.end()
        calls.append(call)
    kept.append(text[position:])
    content = "".join(kept).rstrip()  # (a stream shows the start as it comes: `ToolCallStream`)
    return (content if content.strip() else None) if calls else text, calls


def _held_from_start_tag(text: str) -> int:
    """`held_from` of a format whose calls are `<tool_call>` blocks: from the first one, or from
    what may be the beginning of one at the end."""
    start = text.find(START_TAG)
    return start if start >= 0 else _before_partial(text, START_TAG)


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
        return _block_calls(text, self._read_call)

    def held_from(self, text: str) -> int:
        return _held_from_start_tag(text)

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
        text = _arguments_json(arguments)
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
    except _NOT_JSON:
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


def _held_while_calls_may_begin(text: str, opener: str, tag: str) -> int:
    """`held_from` of a format whose calls are the whole answer: all of it is held while it may
    still be calls (it begins with `opener` or `tag`, or is so far a beginning of `tag`)."""
    start = text.lstrip()
    if not start or start.startswith((opener, tag)) or tag.startswith(start):
        return 0
    return len(text)


def _list_of_calls(call_schemas: list[dict[str, Any]], is_parallel: bool) -> StructuredOutput:
    length = {"minItems": 1} if is_parallel else {"minItems": 1, "maxItems": 1}
    return StructuredOutput("json_schema", json.dumps({"type": "array", "items": _one_of(call_schemas)} | length))


def _json_calls(body: str) -> list[ParsedToolCall] | None:
    """The calls of a JSON list of call objects; None when `body` is not one."""
    try:
        values = json.loads(body)
    except _NOT_JSON:
        return None
    calls = [_call_of(value, ("arguments",)) for value in values] if isinstance(values, list) else [None]
    return [call for call in calls if call is not None] if None not in calls else None


def _python_calls(body: str) -> list[ParsedToolCall]:
    """The calls of a Python list of `name(key=literal, ...)` (none when it is anything else).
    Only parsed, never evaluated: `ast.literal_eval` reads numbers, strings, booleans, None,
    lists, tuples and dicts, and nothing that runs."""
    try:
        with warnings.catch_warnings():  # a model's string with "\d" in it is no warning for the log
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    if not isinstance(tree, ast.List):
        return []
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(k.arg is not None for k in node.keywords)):
            return []  # a positional argument, **kwargs, a method: not this format
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            text = _arguments_json(arguments)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return []  # a value that is not a literal, or not one JSON has (a set, bytes)
        if text is None:
            return []
        calls.append(ParsedToolCall(node.func.id, text))
    return calls


TOOL_PARSERS: dict[str, type[HermesToolParser] | type[Llama3JsonToolParser] | type[MistralToolParser]
                   | type[PythonicToolParser] | type[Qwen3CoderToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser,
    "pythonic": PythonicToolParser, "qwen3_coder": Qwen3CoderToolParser}
assert tuple(TOOL_PARSERS) == TOOL_CALL_PARSERS


class FirstCallOnly:
    """`parallel_tool_calls: false`: the first call the model wrote, the others dropped, as
    vLLM's server filters them (the content stays as parsed). Its required tool_choice is one
    call by its grammar already, as a named one is."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self.arguments_key = parser.arguments_key
        self.streams_arguments = parser.streams_arguments
        self.max_calls: int | None = 1

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        content, calls = self._parser.parse(text)
        return content, calls[:1]

    def held_from(self, text: str) -> int:
        return self._parser.held_from(text)

    def forced_call(self, call_schemas: list[dict[str, Any]], is_parallel: bool = False) -> StructuredOutput:
        return self._parser.forced_call(call_schemas)  # (one call: the first is all this keeps)


def tool_parser(name: str, parallel_calls: bool = True, tools: list[ToolDef] | None = None) -> ToolParser:
    """The parser `--tool-call-parser` names; with `parallel_calls` false, one keeping the first
    call only. `tools`: the request's, whose parameters schemas type the values of a format that
    writes them as text (qwen3_coder)."""
    parser = Qwen3CoderToolParser(tool_parameters(tools or [])) if name == "qwen3_coder" else TOOL_PARSERS[name]()
    return parser if parallel_calls else FirstCallOnly(parser)


def tool_parameters(tools: list[ToolDef]) -> dict[str, dict[str, Any]]:
    """Each tool's parameters schema by its name (a tool without one takes any object)."""
    return {t.function.name: t.function.parameters or {"type": "object"} for t in tools}


def _parse_call(body: str) -> ParsedToolCall | None:
    try:
        value = json.loads(body)
    except _NOT_JSON:
        return None
    return _call_of(value, ("arguments",))


def _call_of(value: Any, argument_keys: tuple[str, ...], call_id: str | None = None) -> ParsedToolCall | None:
    """A call from its JSON object: a string `name`, and an object of arguments under the first
    of `argument_keys` it has; None for anything else. As vLLM's parsers do, an object without
    its arguments (`{"name": "Bob", "age": 3}`: an answer that happens to have a name) is not a
    call: guessing empty arguments would turn the answer into a call and lose the rest of it."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not _is_utf8(value["name"]):
        return None
    arguments = next((value[key] for key in argument_keys if key in value), None)
    if not isinstance(arguments, dict):
        return None
    text = _arguments_json(arguments)
    if text is None:
        return None
    call = ParsedToolCall(value["name"], text)
    return call if call_id is None else dataclasses.replace(call, id=call_id)


def _arguments_json(arguments: dict[Any, Any]) -> str | None:
    """A call's arguments as strict JSON text; None for arguments no client could read back:
    NaN or Infinity (Python's JSON reads them, strict JSON has none), nesting past the
    encoder's depth, or a lone surrogate (a `\\ud800` escape with no pair: no UTF-8 can carry
    it, so the answer could not be sent; the block stays content, its escape plain ASCII)."""
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except _NOT_JSON:
        return None
    return text if _is_utf8(text) else None


def _is_utf8(text: str) -> bool:
    """Whether `text` can be sent (encoded as UTF-8): not when it holds a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _one_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


@dataclass(frozen=True)
class ToolSetup:
    """What a chat request's tools mean for prompting, sampling and formatting."""

    definitions: list[dict[str, Any]] | None  # for the chat template
    parse_calls: bool
    grammar: StructuredOutput | None  # enforced call (required / named)
    grammar_tools: frozenset[str] = frozenset()  # names of the tools the grammar is built from


def tool_setup(body: ChatCompletionRequest, parser: str | None) -> ToolSetup:
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidParameter("tool_choice needs tools; send tools or omit tool_choice", param="tool_choice")
        return ToolSetup(None, False, None)
    if parser is None:
        raise InvalidParameter(f"this server does not parse tool calls; start it with --tool-call-parser "
                               f"({' or '.join(TOOL_CALL_PARSERS)}) or remove tools", param="tools")
    asks_format = body.response_format is not None and body.response_format.type != "text"  # text: the default
    if asks_format and choice not in (None, "none", "auto"):
        raise InvalidParameter("response_format cannot be combined with a required or named tool_choice",
                               param="response_format")
    definitions = [t.model_dump(exclude_none=True) for t in body.tools]
    if choice == "none":
        return ToolSetup(definitions, False, None)
    grammar = _enforced_call(body, choice, tool_parser(parser, body.parallel_tool_calls is not False))
    return ToolSetup(definitions, True, grammar, _grammar_tools(body, choice) if grammar is not None else frozenset())


def _grammar_tools(body: ChatCompletionRequest, choice: Any) -> frozenset[str]:
    assert body.tools is not None
    if isinstance(choice, NamedToolChoice):
        return frozenset([choice.function.name])
    return frozenset(t.function.name for t in body.tools)


def _enforced_call(body: ChatCompletionRequest, choice: Any, parser: ToolParser) -> StructuredOutput | None:
    assert body.tools is not None
    tools = tool_parameters(body.tools)
    key = parser.arguments_key
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in tools:
            raise InvalidParameter(f"tool_choice names function {name!r}, which is not in tools "
                                   f"({', '.join(sorted(tools))})", param="tool_choice")
        tools = {name: tools[name]}
    elif choice != "required":
        return None
    is_parallel = choice == "required"
    grammar = parser.forced_call([call_schema(name, params, key) for name, params in tools.items()], is_parallel)
    if grammar.kind == "qwen3_coder_call":  # its tag holds each tool's parameters as a schema of their own
        return grammar
    _refuse_root_references(tools)
    plain, defs = _hoisted_definitions(tools)
    if not defs:
        return grammar
    grammar = parser.forced_call([call_schema(name, params, key) for name, params in plain.items()], is_parallel)
    return dataclasses.replace(grammar, schema=json.dumps(json.loads(grammar.schema or "{}") | defs))


# Where JSON Schema keeps definitions that `$ref`s name from the schema's root ("#/$defs/Item")
_DEFINITIONS_KEYS = ("$defs", "definitions")


def _refuse_root_references(tools: dict[str, dict[str, Any]]) -> None:
    """400 for a `$ref` to the parameters' root (`#`, a recursive tree) or into it other than by
    its definitions (`#/properties/...`): inside a call's schema that root is the call object,
    so the grammar would hold the model to a shape the tool's schema refuses, without a word."""
    for name, params in tools.items():
        for ref in _references(params):
            if ref == "#" or (ref.startswith("#/") and not ref.startswith(("#/$defs/", "#/definitions/"))):
                raise InvalidParameter(f"tool {name!r}: a forced call (tool_choice required or named) cannot "
                                       f"hold $ref {ref!r}, which points into the parameters' root; put the "
                                       f"shape it names in $defs and refer to it there", param="tools")


def _references(schema: Any) -> Iterator[str]:
    """Every `$ref` string anywhere in `schema`."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _references(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _references(value)


def _hoisted_definitions(tools: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """(each tool's parameters without their definitions, the definitions of them all). A call's
    schema holds the parameters under its `arguments`, so a `$ref` to `#/$defs/Item` (as
    pydantic writes nested models) would look for it at the call's root: the definitions go
    there, as vLLM gathers them. Two tools defining one name differently are refused (400), as
    in vLLM: one grammar cannot hold both."""
    plain: dict[str, dict[str, Any]] = {}
    merged: dict[str, dict[str, Any]] = {}
    for name, params in tools.items():
        plain[name] = {k: v for k, v in params.items() if not (k in _DEFINITIONS_KEYS and isinstance(v, dict))}
        for key in _DEFINITIONS_KEYS:
            defs = params.get(key)
            if not isinstance(defs, dict):
                continue
            into = merged.setdefault(key, {})
            for def_name, definition in defs.items():
                if def_name in into and into[def_name] != definition:
                    raise InvalidParameter(f"tools define {key}/{def_name} differently (in {name!r} and another "
                                           f"tool); give the definitions distinct names", param="tools")
                into[def_name] = definition
    return plain, merged


def call_schema(name: str, parameters: dict[str, Any], arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON Schema of one call's object: the function's name, and its arguments under `arguments_key`."""
    return {"type": "object", "properties": {"name": {"const": name}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


@dataclass(frozen=True)
class CallDelta:
    """One entry of a streamed chunk's `tool_calls`: a call's first (its index, id, type and name,
    with the arguments known so far) or a further piece of its arguments. A client adds up the
    pieces of one index, as OpenAI's clients do."""

    index: int
    arguments: str
    name: str | None = None  # set on a call's first delta only
    id: str | None = None

    def as_openai(self) -> dict[str, Any]:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class StreamStep:
    content: str  # content to send now
    calls: list[CallDelta]  # tool_calls entries to send now


class ToolCallStream:
    """One streamed choice with tool parsing. Text before where a call may begin (the parser's
    `held_from`) streams as content, less any whitespace at its end (which the parser drops
    before a call); the text from there on is content only once the choice has ended and the
    parser has read it all, so the content streamed adds up to the content of the same answer
    unstreamed.

    Calls: with a parser that `streams_arguments` (hermes), a `<tool_call>` block's call is sent
    as it is written: its index, id and name once its name is read and its arguments have begun,
    then the arguments as they come, in the text `json.dumps` gives the parsed arguments (the
    unstreamed call's), and the rest of it when the block's `</tool_call>` comes and the parser
    reads the call (its arguments' last `}` among it). The pieces of an index add up to the
    unstreamed call. A block whose text turns out not to be a call after part of it was sent (cut
    by max_tokens, broken JSON, `</tool_call>` inside a string, a key written twice) cannot be
    taken back: its index is left as sent, arguments that are no whole JSON object, so no client
    can take it for a call to run; its text comes as content as unstreamed, a valid call of it
    is sent whole at the next index, and the finish reason is the unstreamed one ("tool_calls"
    only if the answer has calls). With any other parser the calls are sent whole when the
    choice ends."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._text = ""
        self._num_sent = 0  # of the content
        self._scan_from = 0  # where the next block may begin
        self._block: _StreamedBlock | None = None  # the block being written
        self._num_indices = 0  # handed out to calls
        self._num_calls = 0  # calls read whole

    def feed(self, new_text: str) -> StreamStep:
        """What can be sent now, with `new_text` added to the choice's text."""
        self._text += new_text
        safe = len(self._text[:self._parser.held_from(self._text)].rstrip())
        content = self._text[self._num_sent:max(safe, self._num_sent)]
        self._num_sent += len(content)
        return StreamStep(content, self._call_deltas() if self._parser.streams_arguments else [])

    def finish(self) -> tuple[str, list[CallDelta], bool]:
        """(content not yet sent, calls not yet sent, whether the answer has calls), once the
        choice has ended (after the `feed` of its last text)."""
        content, calls = self._parser.parse(self._text)
        whole = (content or "") if calls else self._text
        # What was sent is text before the first call, so `whole` begins with it
        num_sent = len(os.path.commonprefix([whole, self._text[:self._num_sent]]))
        self._num_sent = len(self._text)
        if self._parser.streams_arguments:
            return whole[num_sent:], [], bool(calls)
        return whole[num_sent:], [CallDelta(i, c.arguments, c.name, c.id) for i, c in enumerate(calls)], bool(calls)

    def _call_deltas(self) -> list[CallDelta]:
        deltas: list[CallDelta] = []
        while True:
            if self._block is None:
                if self._parser.max_calls is not None and self._num_calls >= self._parser.max_calls:
                    return deltas  # (the parser keeps no further call)
                start = self._text.find(START_TAG, self._scan_from)
                if start < 0:
                    self._scan_from = max(self._scan_from, len(self._text) - len(START_TAG) + 1)
                    return deltas
                self._block = _StreamedBlock(start)
            block = self._block
            end = self._text.find(END_TAG, max(block.body_start, block.end_scan))
            block.end_scan = len(self._text) - len(END_TAG) + 1  # no end tag wholly before this
            block.read(self._text, end if end >= 0 else max(block.body_start, _before_partial(self._text, END_TAG)))
            deltas += self._arguments_delta(block)
            if end < 0:
                return deltas
            deltas += self._resolve(block)
            self._scan_from, self._block = end + len(END_TAG), None

    def _arguments_delta(self, block: _StreamedBlock) -> list[CallDelta]:
        name, fresh = block.name_and_arguments()
        if name is None or fresh is None:
            return []
        block.num_sent += len(fresh)
        if block.index is None:
            block.index, block.id = self._num_indices, _openai_id()
            self._num_indices += 1
            return [CallDelta(block.index, fresh, name, block.id)]
        return [CallDelta(block.index, fresh)] if fresh else []

    def _resolve(self, block: _StreamedBlock) -> list[CallDelta]:
        """The rest of a block's call once its end tag is here: read as `parse` reads it (the
        same block: the first end tag after its start); nothing when it is no call (content)."""
        match = _CALL.match(self._text, block.start)
        call = _parse_call(match.group(1)) if match else None
        if call is None:
            return []
        self._num_calls += 1
        sent = block.sent_arguments()
        if block.index is not None and block.name == call.name and call.arguments.startswith(sent):
            rest = call.arguments[len(sent):]
            return [CallDelta(block.index, rest)] if rest else []
        index = self._num_indices
        self._num_indices += 1
        return [CallDelta(index, call.arguments, call.name, call.id)]



class _StreamedBlock:
    """A hermes `<tool_call>` block being written: its body (from after the tag, whitespace
    skipped as the parser skips it) read as canonical JSON as it comes (`CanonicalJson`)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.body_start = start + len(START_TAG)
        self.json = CanonicalJson()
        self.index: int | None = None  # once its first delta is sent
        self.id: str | None = None
        self.name: str | None = None
        self.num_sent = 0  # of the arguments' canonical text
        self.end_scan = 0  # where the search for its end tag goes on from
        self._num_read = 0  # of the body's text
        self._has_begun = False  # past the whitespace before the body

    def read(self, text: str, limit: int) -> None:
        """Read the body's text up to `limit` (past it may be the end tag)."""
        new = text[self.body_start + self._num_read:limit]
        self._num_read += len(new)
        if not self._has_begun:
            new = new.lstrip()
            self._has_begun = bool(new)
        if new:
            self.json.feed(new)

    def name_and_arguments(self) -> tuple[str | None, str | None]:
        """(the call's name, the canonical text of its arguments not yet sent: past `num_sent`),
        each None until it is known (or when the body is no call this stream can follow)."""
        if self.json.failed or self.json.top_kind != "{":
            return None, None
        members = self.json.members
        name = members.get("name")
        text = self.json
        if self.name is None and name is not None and name.end is not None and text.slice(name.start,
                                                                                            name.start + 1) == '"':
            self.name = json.loads(text.slice(name.start, name.end))
        arguments = members.get("arguments")
        if self.name is None or arguments is None or text.slice(arguments.start, arguments.start + 1) != "{":
            return self.name, None
        # Whole arguments wait for the parser's reading of the block: a call left unfinished
        # (`ToolCallStream`) is never one a client could take for whole
        end = arguments.end - 1 if arguments.end is not None else text.length
        start = arguments.start + self.num_sent
        return self.name, text.slice(start, end)

    def sent_arguments(self) -> str:
        arguments = self.json.members.get("arguments")
        return "" if arguments is None else self.json.slice(arguments.start, arguments.start + self.num_sent)


@dataclass
class Member:
    """Where a member's value of a JSON object stands in its canonical text: from `start`, to
    `end` once the value is whole (None until then)."""

    start: int
    end: int | None = None


_JSON_SPACE = frozenset(" \t\n\r")
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_JSON_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset(string.hexdigits)


class CanonicalJson:
    """One JSON value's canonical text, `json.dumps(json.loads(raw), ensure_ascii=False)`, as its
    raw text comes: `feed` adds what the raw text so far settles (a string's characters as they
    come, a number or literal once it ends), so `text` is always a beginning of the whole
    value's. It reads JSON as json.loads does, and stops (`failed`, `text` kept as it was) at
    anything json.loads would refuse, at NaN or Infinity (which no call's arguments may hold),
    and at a key written twice in one object (json.loads keeps the last value in the first one's
    place: not a continuation of the text so far). `members`: where each member of the value,
    when it is an object, stands in the text (`length`, `slice`).

    The text is kept as the pieces it was emitted in, with their offsets: a piece of it costs
    its own length to read (`slice`), never the whole text's, so a long call streams in time
    linear in its length (the frontend's event loop is every tenant's)."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._offsets: list[int] = []  # where each piece starts in the text
        self.length = 0  # of the text so far
        self.failed = False
        self.top_kind = ""  # the value's first character, once read
        self.members: dict[str, Member] = {}
        self._stack: list[set[str] | None] = []  # per open container: an object's keys, None for an array
        self._expect = "value"  # value, value_or_close, key, key_or_close, colon, comma_or_close, done
        self._token = ""  # a number or literal being read
        self._string: list[str] | None = None  # the string being read, decoded
        self._is_key = False
        self._escape = ""  # an escape being read, from its backslash
        self._high_surrogate: int | None = None  # a \uD800-\uDBFF escape, paired if a low one follows
        self._last_key = ""  # of the top object's member being read

    def feed(self, raw: str) -> None:
        for char in raw:
            if self.failed:
                return
            if self._string is not None:
                self._string_char(char)
            elif self._token and (char.isalnum() or char in "+-."):
                self._token += char
            else:
                if self._token:
                    self._end_token()
                if not self.failed and char not in _JSON_SPACE:
                    self._structural(char)

    def _structural(self, char: str) -> None:
        expect = self._expect
        if expect in ("value", "value_or_close") and char not in "]}":
            self._begin_value(char)
        elif expect in ("key", "key_or_close") and char == '"':
            self._begin_string(is_key=True)
        elif expect == "colon" and char == ":":
            self._emit(": ")
            self._expect = "value"
        elif expect == "comma_or_close" and char == ",":
            self._emit(", ")
            self._expect = "key" if self._stack[-1] is not None else "value"
        elif expect in ("key_or_close", "comma_or_close") and char == "}" and self._stack[-1] is not None:
            self._close("}")
        elif expect in ("value_or_close", "comma_or_close") and char == "]" and self._stack[-1] is None:
            self._close("]")
        else:
            self.failed = True

    def _begin_value(self, char: str) -> None:
        if not self._stack:
            self.top_kind = char
        elif len(self._stack) == 1 and self._stack[0] is not None:
            self.members[self._last_key].start = self.length
        if char in "{[":
            self._emit(char)
            self._stack.append(set() if char == "{" else None)
            self._expect = "key_or_close" if char == "{" else "value_or_close"
        elif char == '"':
            self._begin_string(is_key=False)
        elif char == "-" or char.isalnum():
            self._token = char
        else:
            self.failed = True

    def _close(self, char: str) -> None:
        self._emit(char)
        self._stack.pop()
        self._value_done()

    def _value_done(self) -> None:
        if not self._stack:
            self._expect = "done"
            return
        if len(self._stack) == 1 and self._stack[0] is not None:
            self.members[self._last_key].end = self.length
        self._expect = "comma_or_close"

    def _end_token(self) -> None:
        token, self._token = self._token, ""
        if token in ("true", "false", "null"):
            self._emit(token)
        elif _JSON_NUMBER.fullmatch(token):
            try:  # (an integer past Python's digit limit, a float past its range: refused as json.loads / dumps do)
                self._emit(json.dumps(json.loads(token), allow_nan=False))
            except ValueError:
                self.failed = True
                return
        else:
            self.failed = True
            return
        self._value_done()

    def _begin_string(self, is_key: bool) -> None:
        self._string, self._is_key = [], is_key
        self._emit('"')

    def _string_char(self, char: str) -> None:
        if self._escape:
            self._escape_char(char)
        elif char == "\\":
            self._escape = char
        elif char == '"':
            self._end_string()
        elif char < " ":
            self.failed = True  # (json.loads is strict: no raw control character in a string)
        else:
            self._decoded(char)

    def _escape_char(self, char: str) -> None:
        self._escape += char
        if len(self._escape) == 2 and char != "u":
            decoded = _JSON_ESCAPES.get(char)
            self._escape = ""
            if decoded is None:
                self.failed = True
            else:
                self._decoded(decoded)
        elif len(self._escape) > 2 and char not in _HEX:
            self.failed = True
        elif len(self._escape) == 6:
            unit, self._escape = int(self._escape[2:], 16), ""
            self._code_unit(unit)

    def _code_unit(self, unit: int) -> None:
        """A \\u escape's unit: a high surrogate waits for a low one to make one character with;
        a lone one stops the reading, as the parser refuses it (`_arguments_json`)."""
        if self._high_surrogate is not None and 0xDC00 <= unit <= 0xDFFF:
            high, self._high_surrogate = self._high_surrogate, None
            self._decoded(chr(0x10000 + ((high - 0xD800) << 10) + (unit - 0xDC00)))
        elif 0xD800 <= unit <= 0xDBFF:
            self._flush_surrogate()
            self._high_surrogate = unit
        elif 0xDC00 <= unit <= 0xDFFF:
            self.failed = True
        else:
            self._decoded(chr(unit))

    def _flush_surrogate(self) -> None:
        if self._high_surrogate is not None:  # a high surrogate no low one followed
            self.failed = True

    def _decoded(self, char: str) -> None:
        assert self._string is not None
        self._flush_surrogate()
        if self.failed:
            return
        self._string.append(char)
        self._emit(json.dumps(char, ensure_ascii=False)[1:-1] if char < " " or char in '"\\' else char)

    def _end_string(self) -> None:
        assert self._string is not None
        self._flush_surrogate()
        if self.failed:
            return
        value, self._string = "".join(self._string), None
        self._emit('"')
        if not self._is_key:
            self._value_done()
            return
        keys = self._stack[-1]
        assert keys is not None
        if value in keys:
            self.failed = True
            return
        keys.add(value)
        if len(self._stack) == 1:
            self._last_key = value
            self.members[value] = Member(self.length)
        self._expect = "colon"

    @property
    def text(self) -> str:
        """The canonical text so far, whole (a copy of all of it: `slice` reads a piece)."""
        return self.slice(0, self.length)

    def slice(self, start: int, end: int) -> str:
        """The text's characters from `start` to `end`, read from the pieces that hold them."""
        if start >= end:
            return ""
        first = bisect.bisect_right(self._offsets, start) - 1
        last = bisect.bisect_left(self._offsets, end)
        joined = "".join(self._pieces[first:last])
        base = self._offsets[first]
        return joined[start - base:end - base]

    def _emit(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self._offsets.append(self.length)
            self.length += len(text)


def _before_partial(text: str, tag: str) -> int:
    """Where a possible beginning of `tag` at the end of `text` starts (len(text) if none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return len(text) - size
    return len(text)
