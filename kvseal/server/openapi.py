"""The OpenAPI document: generation routes parse their bodies themselves (so the key is
checked before the body is read), so their request schemas are added here."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_ERROR_SCHEMA = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_ERROR_STATUSES = {"400": "Invalid request", "401": "Missing or unknown API key", "404": "Unknown model",
                   "413": "Body too large", "429": "Tenant concurrency limit", "503": "Engine unavailable"}


def install_openapi(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """`bodies` maps each POST path to the model its JSON body must satisfy."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app, bodies)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _build(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["Error"] = _ERROR_SCHEMA
    schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, model in bodies.items():
        body_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body_schema.pop("$defs", {}))
        components[model.__name__] = body_schema
        operation = schema["paths"][path]["post"]
        operation["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        operation["security"] = [{"bearer": []}]
        operation["responses"].update({code: {"description": text, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/Error"}}}} for code, text in _ERROR_STATUSES.items()})
    return schema
