"""The door checks on a JSON Schema, before a request is admitted (no tokenizer needed).

`response_format`'s schema and every tool's `parameters` pass the same bounds: at most
`MAX_SCHEMA_CHARS` characters, `MAX_SCHEMA_DEPTH` nested objects and arrays, and
`MAX_SCHEMA_PROPERTIES` properties in all. A grammar that will be built from a schema is also
parsed by xgrammar here, so a schema it cannot turn into a grammar is a 400 naming the
problem. The bounds keep that parse cheap (it grows faster than the nesting: 0.03 s at 64
levels, a minute at 1,000); the compile itself is bounded by the engine's CPU-time budget
(`--grammar-compile-timeout-s`). A request's tools are also bounded in number (`MAX_TOOLS`,
in the chat request's body model) and in total size (`MAX_TOOLS_CHARS`).

Pure functions; a big schema may take a few milliseconds, so callers run them off the event
loop.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvseal._testing.faults import Fault, is_active
from kvseal.errors import InvalidParameter
from kvseal.structured.grammars import choice_grammar
from kvseal.structured.keywords import unenforced_keyword
from kvseal.types import StructuredOutput

MAX_SCHEMA_CHARS = 64 * 1024
MAX_SCHEMA_DEPTH = 64  # objects and arrays nested in the schema document
MAX_SCHEMA_PROPERTIES = 5000  # "properties" entries over the whole schema (OpenAI's bound)
MAX_TOOLS = 128  # OpenAI's bound, in the chat request's body model
MAX_TOOLS_CHARS = 4 * MAX_SCHEMA_CHARS  # every tool definition of a request, as JSON

_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:123: " prefix
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def check_schema(schema_json: str, where: str = "the JSON schema in response_format",
                 param: str = "response_format") -> None:
    """Raise `InvalidParameter` (`param`) naming what is wrong with the schema `where` names:
    over a bound, or something xgrammar cannot turn into a grammar (bad JSON Schema, or a
    feature it does not support)."""
    check_schema_bounds(schema_json, where, param)
    if (unenforced := unenforced_keyword(schema_json)) is not None:
        raise InvalidParameter(f"{where} uses {unenforced}, which the grammar cannot enforce while sampling: the "
                               f"output would not be held to it; remove it", param=param)
    import xgrammar

    try:
        xgrammar.Grammar.from_json_schema(schema_json)
    except (RuntimeError, ValueError) as exc:
        raise InvalidParameter(f"invalid JSON schema in {where}: {describe_error(exc)}", param=param) from None


MAX_CHOICES = 1024  # strings of one guided_choice


def check_spec(spec: StructuredOutput, where: str, param: str) -> None:
    """The door check on any structured-output spec a request sends (`where` names it in the
    message, `param` in the 400): a JSON Schema as `check_schema`; a regex, a choice list or an
    EBNF grammar within `MAX_SCHEMA_CHARS` (a choice list also within `MAX_CHOICES` strings),
    and parsed by xgrammar, so one it cannot read is a 400 naming the problem."""
    if spec.kind == "json_schema":
        check_schema(spec.schema or "", where, param)
        return
    if spec.kind not in ("regex", "choice", "grammar") or spec.schema is None:
        return
    if len(spec.schema) > MAX_SCHEMA_CHARS:
        raise InvalidParameter(f"{where} has {len(spec.schema)} characters; the limit is {MAX_SCHEMA_CHARS}",
                               param=param)
    if spec.kind == "choice" and (num_choices := len(json.loads(spec.schema))) > MAX_CHOICES:
        raise InvalidParameter(f"{where} has {num_choices} strings; the limit is {MAX_CHOICES}", param=param)
    import xgrammar

    try:
        if spec.kind == "regex":
            xgrammar.Grammar.from_regex(spec.schema)
        elif spec.kind == "choice":
            xgrammar.Grammar.from_ebnf(choice_grammar(spec.schema))
        else:
            xgrammar.Grammar.from_ebnf(spec.schema)
    except (RuntimeError, ValueError) as exc:
        raise InvalidParameter(f"invalid {where}: {describe_error(exc)}", param=param) from None


def check_schema_bounds(schema_json: str, where: str, param: str) -> None:
    """Size, nesting depth and number of properties, each against its limit."""
    if len(schema_json) > MAX_SCHEMA_CHARS:
        raise InvalidParameter(f"{where} has {len(schema_json)} characters; the limit is {MAX_SCHEMA_CHARS}. "
                               f"Send a smaller schema.", param=param)
    depth = json_depth(schema_json)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidParameter(f"{where} nests objects and arrays {depth} deep; the limit is {MAX_SCHEMA_DEPTH}. "
                               f"Flatten the schema.", param=param)
    try:
        value = json.loads(schema_json)
    except ValueError as exc:
        raise InvalidParameter(f"{where} is not valid JSON: {exc}", param=param) from None
    num_properties = count_properties(value)
    if num_properties > MAX_SCHEMA_PROPERTIES:
        raise InvalidParameter(f"{where} has {num_properties} properties; the limit is {MAX_SCHEMA_PROPERTIES}. "
                               f"Send a schema with fewer properties.", param=param)


def check_tools(tools: list[dict[str, Any]], grammar_tools: frozenset[str]) -> None:
    """The door checks on a chat request's `tools` (param "tools"; their number, at most
    `MAX_TOOLS`, is bounded by the request body's model): their total size, every `parameters`
    schema's bounds, and the full check (xgrammar too) for the tools whose schemas a required
    or named call's grammar is built from (`grammar_tools`, by name)."""
    if is_active(Fault.SKIP_TOOL_DOOR_CHECKS):
        return
    total_chars = len(json.dumps(tools, separators=(",", ":"), ensure_ascii=False))
    if total_chars > MAX_TOOLS_CHARS:
        raise InvalidParameter(f"the tool definitions have {total_chars} characters as JSON; the limit is "
                               f"{MAX_TOOLS_CHARS}. Send fewer or smaller tools.", param="tools")
    for index, tool in enumerate(tools):
        function = tool.get("function", {})
        schema_json = json.dumps(function.get("parameters") or {"type": "object"})
        where = f"tools[{index}].function.parameters"
        if function.get("name") in grammar_tools:
            check_schema(schema_json, where, "tools")
        else:
            check_schema_bounds(schema_json, where, "tools")


def json_depth(text: str) -> int:
    """How deep objects and arrays nest in a JSON text (strings skipped), without parsing it:
    a parser would recurse that deep."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRING.sub('""', text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def count_properties(schema: Any) -> int:
    """The entries of every "properties" object in the schema, at any depth."""
    total = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            properties = node.get("properties")
            if isinstance(properties, dict):
                total += len(properties)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return total


def describe_error(exc: Exception) -> str:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _LOG_PREFIX.sub("", first_line)
