"""`response_format` → `SamplingParams.structured`, with the schema checked at the door.

A schema xgrammar cannot turn into a grammar is a 400 naming the problem (param
`response_format`), found here before anything reaches the engine. The check runs on a
worker thread: a large schema must not hold up the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

from kvseal.errors import InvalidParameter
from kvseal.server.protocol import ResponseFormat
from kvseal.structured.schema import check_schema
from kvseal.types import SamplingParams, StructuredOutput


async def with_response_format(params: SamplingParams, response_format: ResponseFormat | None) -> SamplingParams:
    if response_format is None or response_format.type == "text":
        return params
    if response_format.type == "json_object":
        return dataclasses.replace(params, structured=StructuredOutput("json_object"))
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise InvalidParameter("response_format of type json_schema needs json_schema.schema (a JSON Schema "
                               "object)", param="response_format")
    schema_json = json.dumps(spec.json_schema)
    await asyncio.to_thread(check_schema, schema_json)
    return dataclasses.replace(params, structured=StructuredOutput("json_schema", schema_json))
