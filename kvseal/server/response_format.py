"""The structured output a request asks for -> `SamplingParams.structured`, checked at the door.

A request may ask in one way only: OpenAI's `response_format` (`json_object`, `json_schema`), or
one of vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`; two are a 400, and so is
any of them beside a required or named tool call (whose grammar is already set). A spec
xgrammar cannot read is a 400 naming the problem and the field, found here before anything
reaches the engine. The check runs on a worker thread: a large schema must not hold up the
event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from kvseal.errors import InvalidParameter
from kvseal.server.protocol import GenerationBody, ResponseFormat
from kvseal.structured.schema import check_spec
from kvseal.types import SamplingParams, StructuredOutput, StructuredOutputsParams


async def with_structured_output(params: SamplingParams, body: GenerationBody) -> SamplingParams:
    asked = _asked(body)
    if not asked:
        return params
    if len(asked) > 1:
        names = ", ".join(param for param, _, _ in asked)
        raise InvalidParameter(f"the request asks for structured output in {len(asked)} ways ({names}); send one",
                               param=asked[1][0])
    [(param, where, spec)] = asked
    if params.structured is not None:  # a required or named tool call's grammar
        raise InvalidParameter(f"{param} cannot be combined with a required or named tool_choice", param=param)
    await asyncio.to_thread(check_spec, spec, where, param)
    return dataclasses.replace(params, structured=spec)


def _asked(body: GenerationBody) -> list[tuple[str, str, StructuredOutput]]:
    """(field, how its errors name the spec, the spec) for every way the request asked."""
    asked = []
    if body.response_format is not None and body.response_format.type != "text":
        asked.append(("response_format", "the JSON schema in response_format", _response_format(body.response_format)))
    if body.structured_outputs is not None:
        so = body.structured_outputs
        params = StructuredOutputsParams(so.json_spec, so.regex, so.choice, so.grammar, so.json_object)
        asked.append(("structured_outputs", "structured_outputs", params.as_structured()))
    guided: list[tuple[str, Any]] = [("guided_json", body.guided_json), ("guided_regex", body.guided_regex),
                                     ("guided_choice", body.guided_choice), ("guided_grammar", body.guided_grammar)]
    for param, value in guided:
        if value is not None:
            kind = param.removeprefix("guided_")
            where = "the JSON schema in guided_json" if kind == "json" else param
            asked.append((param, where, StructuredOutputsParams(**{kind: value}).as_structured(param)))
    return asked


def _response_format(response_format: ResponseFormat) -> StructuredOutput:
    if response_format.type == "json_object":
        return StructuredOutput("json_object")
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise InvalidParameter("response_format of type json_schema needs json_schema.schema (a JSON Schema "
                               "object)", param="response_format")
    return StructuredOutput("json_schema", json.dumps(spec.json_schema))
