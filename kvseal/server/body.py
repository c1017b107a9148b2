"""The request body: read it within its size (413) and time (408) limits, parse it (400)."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from kvseal.server import errors
from kvseal.server.errors import ApiError

Body = TypeVar("Body", bound=BaseModel)


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
