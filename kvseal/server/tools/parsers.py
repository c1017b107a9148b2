"""The call parsers `--tool-call-parser` names (`TOOL_PARSERS`): each reads an answer's text into
(content, calls), as vLLM's parser of that name does."""

from __future__ import annotations

import ast
import json
import warnings
from typing import Any, Protocol

from kvseal.server.config import TOOL_CALL_PARSERS
from kvseal.server.protocol import ToolDef
from kvseal.server.tools.calls import (
    MISTRAL_CALLS,
    NOT_JSON,
    PYTHON_END,
    PYTHON_START,
    PYTHON_TAG,
    ParsedToolCall,
    arguments_json,
    block_calls,
    call_of,
    mistral_id,
    openai_id,
    parse_json_call,
)
from kvseal.server.tools.python_calls import PythonCallDraft
from kvseal.server.tools.qwen3_coder import Qwen3CoderToolParser
from kvseal.server.tools.readers import (
    BlockReader,
    CallReader,
    JsonCallDraft,
    JsonObjectsBody,
    ListBody,
    WholeAnswerReader,
)
from kvseal.types import StructuredOutput


class ToolParser(Protocol):
    arguments_key: str  # the key of a call's arguments in its JSON object, in this format
    max_calls: int | None  # the most calls `parse` returns (None: all)

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content outside the calls, or None when there is none besides calls; the calls)."""
        ...

    def call_reader(self) -> CallReader:
        """A reader of this format's calls as the text comes, for a stream (`ToolCallStream`)."""
        ...

    def new_call_id(self) -> str:
        """An id for a call, as this format's calls have them."""
        ...

    def forced_call(self, call_schemas: list[dict[str, Any]], is_parallel: bool = False) -> StructuredOutput:
        """The grammar of one call in this format, its JSON one of `call_schemas` (`call_schema`'s,
        with this format's arguments key); with `is_parallel`, of one or more calls where the
        format can hold several (hermes, mistral, pythonic: tool_choice required, as vLLM's list
        of at least one call), one where it cannot (llama3_json, qwen3_coder)."""
        ...


class HermesToolParser:
    arguments_key = "arguments"
    max_calls: int | None = None

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content outside the calls or None, the calls). A block that is not a JSON object with
        a string `name` is left in the content, as text, rather than guessed at."""
        return block_calls(text, parse_json_call)

    def call_reader(self) -> CallReader:
        return BlockReader(lambda: JsonCallDraft(("arguments",), stops_when_whole=False), parse_json_call)

    def new_call_id(self) -> str:
        return openai_id()

    def forced_call(self, call_schemas: list[dict[str, Any]], is_parallel: bool = False) -> StructuredOutput:
        return StructuredOutput("tool_calls" if is_parallel else "tool_call", json.dumps(_one_of(call_schemas)))


class Llama3JsonToolParser:
    arguments_key = "parameters"
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
            except NOT_JSON:
                return text, []
            call = call_of(value, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            while position < len(body) and (body[position].isspace() or body[position] == ";"):
                position += 1
        return None, calls

    def call_reader(self) -> CallReader:
        return WholeAnswerReader(PYTHON_TAG, "{", JsonObjectsBody())

    def new_call_id(self) -> str:
        return openai_id()

    def forced_call(self, call_schemas: list[dict[str, Any]], is_parallel: bool = False) -> StructuredOutput:
        """One call, parallel or not: the JSON grammar holds one value (calls joined by `;` are
        no JSON value)."""
        return StructuredOutput("json_schema", json.dumps(_one_of(call_schemas)))


class MistralToolParser:
    arguments_key = "arguments"
    max_calls: int | None = None

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """All calls, or none: an answer that is not one JSON list of calls (after
        `[TOOL_CALLS]`) is content, as it is."""
        body = text.strip().removeprefix(MISTRAL_CALLS).lstrip()
        if not body.startswith("["):
            return text, []
        try:
            values = json.loads(body)
        except NOT_JSON:
            return text, []
        calls = []
        for value in values:  # (a list: the text began with "[")
            call = call_of(value, ("arguments",), mistral_id())
            if call is None:
                return text, []
            calls.append(call)
        return (None, calls) if calls else (text, [])

    def call_reader(self) -> CallReader:
        return WholeAnswerReader(MISTRAL_CALLS, "[", ListBody())

    def new_call_id(self) -> str:
        return mistral_id()

    def forced_call(self, call_schemas: list[dict[str, Any]], is_parallel: bool = False) -> StructuredOutput:
        """A list of one call, or of one or more with `is_parallel` (the `[TOOL_CALLS]` token
        before it is special: no grammar writes it, and the parser does without it)."""
        return _list_of_calls(call_schemas, is_parallel)


class PythonicToolParser:
    arguments_key = "arguments"  # of the enforced call's JSON (`forced_call`)
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

    def call_reader(self) -> CallReader:
        return WholeAnswerReader(PYTHON_START, "[", ListBody(PythonCallDraft))

    def new_call_id(self) -> str:
        return openai_id()

    def forced_call(self, call_schemas: list[dict[str, Any]], is_parallel: bool = False) -> StructuredOutput:
        """A JSON list of one call (one or more with `is_parallel`): a Python call's arguments have
        no schema a grammar could hold them to, a JSON object's do."""
        return _list_of_calls(call_schemas, is_parallel)


def _list_of_calls(call_schemas: list[dict[str, Any]], is_parallel: bool) -> StructuredOutput:
    length = {"minItems": 1} if is_parallel else {"minItems": 1, "maxItems": 1}
    return StructuredOutput("json_schema", json.dumps({"type": "array", "items": _one_of(call_schemas)} | length))


def _json_calls(body: str) -> list[ParsedToolCall] | None:
    """The calls of a JSON list of call objects; None when `body` is not one."""
    try:
        values = json.loads(body)
    except NOT_JSON:
        return None
    calls = [call_of(value, ("arguments",)) for value in values] if isinstance(values, list) else [None]
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
            text = arguments_json(arguments)
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
        self.max_calls: int | None = 1

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        content, calls = self._parser.parse(text)
        return content, calls[:1]

    def call_reader(self) -> CallReader:
        return self._parser.call_reader()

    def new_call_id(self) -> str:
        return self._parser.new_call_id()

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


def _one_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
