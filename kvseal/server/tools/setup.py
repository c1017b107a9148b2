"""What a chat request's `tools` and `tool_choice` mean before sampling: the definitions for the
template, and the grammar of an enforced call (required or named)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvseal.errors import InvalidParameter
from kvseal.server.config import TOOL_CALL_PARSERS
from kvseal.server.protocol import ChatCompletionRequest, NamedToolChoice
from kvseal.server.tools.parsers import ToolParser, tool_parameters, tool_parser
from kvseal.types import StructuredOutput


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
