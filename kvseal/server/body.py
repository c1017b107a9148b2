"""The request body: read it within its size (413) and time (408) limits, parse it (400).

Parsing costs by the objects a body holds more than by its bytes: 15 MB of empty content parts
(450,000 of them) took ~2.3 s to validate, and on the event loop that stalled every tenant's
requests and /health meanwhile. So:

- A body of `INLINE_PARSE_BYTES` or more is parsed by `BodyParser` on one worker thread that
  every tenant shares, in per-tenant turns (`FairLane`): one tenant's big bodies hold up
  another tenant's big body by at most the one parse running, and never a small body. The
  event loop still shares the GIL with the parse: it gets its turn within the interpreter's
  switch interval (5 ms) while the parser calls back into Python (its validators do, for
  every message and content part), and `body_shape`'s bounds keep the stretches where it does
  not short.
- Before that parse, the body's JSON objects, arrays and object members are counted and
  bounded (`body_shape`, 400 `body_too_complex`): each becomes a Python object, many of them a
  validated model (a message, a content part, a tool call), and building them costs ~5 µs a
  model; where the parser builds them without calling back into Python it holds the GIL
  throughout, and freeing them all at once when the request ends holds it too (~0.2 s for the
  450,000 parts above).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from kvseal.server import errors
from kvseal.server.body_shape import check_body_shape
from kvseal.server.errors import ApiError
from kvseal.server.fair_lane import FairLane

Body = TypeVar("Body", bound=BaseModel)
Parsed = TypeVar("Parsed")
# smaller bodies are parsed on the event loop: at most ~4 ms (64 KiB of empty content parts, the
# costliest shape per byte, measured); they are within body_shape's limits ("[]" is 2 bytes, '"":0,' 5)
INLINE_PARSE_BYTES = 64 * 1024


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body, or `ApiError` 413 as soon as it exceeds `max_bytes` (read no further),
    or 408 when it has not all arrived `timeout_s` after the headers (a slow client)."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise errors.body_too_large(max_bytes)
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_within(request, max_bytes)
    except TimeoutError:
        raise errors.body_timeout(timeout_s) from None


async def _read_within(request: Request, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise errors.body_too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


class BodyParser:
    """Parses bodies off the event loop once they are big enough to hold it (the module's docstring)."""

    def __init__(self) -> None:
        self._lane = FairLane("kvseal-body")

    async def parse(self, model: type[Body], data: bytes, tenant: str) -> Body:
        """`parse_body(model, data)`, in the tenant's turn when the body is big."""
        return await self.run(functools.partial(parse_body, model), data, tenant)

    async def run(self, parse: Callable[[bytes], Parsed], data: bytes, tenant: str) -> Parsed:
        """`parse(data)`: on the event loop for a body under `INLINE_PARSE_BYTES`, else on the
        worker thread in the tenant's turn, once its shape is within bounds. Raises `ApiError` 400
        `body_too_complex`, or what `parse` raises (the body's 400)."""
        if len(data) < INLINE_PARSE_BYTES:
            return parse(data)
        result: Parsed = await self._lane.run(tenant, _counted_then_parsed, parse, data)
        return result

    def close(self) -> None:
        """Stop the worker; parses still queued are cancelled."""
        self._lane.close()


def _counted_then_parsed(parse: Callable[[bytes], Parsed], data: bytes) -> Parsed:
    check_body_shape(data)
    return parse(data)


def parse_body(model: type[Body], data: bytes) -> Body:
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise _to_api_error(exc) from None


def _to_api_error(exc: ValidationError) -> ApiError:
    problems = exc.errors(include_url=False, include_context=False, include_input=False)
    first = problems[0]
    if first["type"] == "json_invalid":
        return errors.invalid_json(first["msg"])
    if not first["loc"]:
        return errors.invalid_json(f"the body must be a JSON object: {first['msg']}")
    param = str(first["loc"][0])
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"Unsupported parameter '{_path(first)}': kvseal does not implement it. "
                             f"Remove it from the request.", code="unsupported_parameter", param=param)
    same_field = [p for p in problems if p["loc"] and str(p["loc"][0]) == param][:3]
    detail = "; ".join(f"{_path(p)}: {p['msg']}" for p in same_field)
    return ApiError(400, f"Invalid value for '{param}': {detail}.", code="invalid_parameter", param=param)


def _path(problem: Any) -> str:
    return ".".join(str(part) for part in problem["loc"])


def require_json(request: Request) -> None:
    """Only JSON bodies: a form or text/plain POST (no CORS preflight) is refused with 415."""
    content_type = request.headers.get("content-type", "")
    if content_type.partition(";")[0].strip().lower() != "application/json":
        raise errors.unsupported_media_type(content_type)
