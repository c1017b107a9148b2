"""The FastAPI application: routes, and OpenAI-shaped errors for everything else."""

from __future__ import annotations

import dataclasses
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvseal._testing.faults import Fault, is_active
from kvseal.server import errors
from kvseal.server.admin import add_admin_routes
from kvseal.server.audit import clip
from kvseal.server.auth import authorization_of
from kvseal.server.chat import ChatEndpoint
from kvseal.server.completions import CompletionsEndpoint
from kvseal.server.errors import ApiError
from kvseal.server.openapi import install_openapi
from kvseal.server.pipeline import handle_generation
from kvseal.server.responses import ResponsesEndpoint, response_not_found
from kvseal.server.responses_body import ResponsesRequest
from kvseal.server.state import AppState
from kvseal.server.tokenize_routes import add_tokenize_routes
from kvseal.version import __version__

logger = logging.getLogger("kvseal.server")

COMPLETIONS = CompletionsEndpoint()
CHAT = ChatEndpoint()


def build_app(state: AppState) -> FastAPI:
    # No /docs or /redoc (their pages load scripts from a CDN); /openapi.json is served below,
    # behind an API key like every route that is not an operator probe. A path with a trailing
    # slash is a 404 like any unknown path, never a redirect to a URL built from the client's
    # Host header.
    app = FastAPI(title="kvseal", version=__version__, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    chat = ChatEndpoint(state.config.tool_call_parser, state.reasoning)
    _add_generation_routes(app, state, chat, ResponsesEndpoint(chat))
    _add_info_routes(app, state)
    add_tokenize_routes(app, state)
    add_admin_routes(app, state)
    _add_error_handlers(app)
    install_openapi(app, {COMPLETIONS.path: COMPLETIONS.body_model, CHAT.path: CHAT.body_model,
                          ResponsesEndpoint.path: ResponsesRequest})
    _add_openapi_route(app, state)
    return app


def _add_openapi_route(app: FastAPI, state: AppState) -> None:
    @app.get("/openapi.json", response_model=None, include_in_schema=False)
    async def openapi(request: Request) -> Response:
        try:
            if not is_active(Fault.SKIP_DOOR_CHECKS):
                state.keys.authenticate(authorization_of(request.headers))
        except ApiError as err:
            return errors.response(err)
        return JSONResponse(app.openapi())


def _add_generation_routes(app: FastAPI, state: AppState, chat: ChatEndpoint, responses: ResponsesEndpoint) -> None:
    @app.post(COMPLETIONS.path, response_model=None)
    async def completions(request: Request) -> Response:
        return await handle_generation(request, state, COMPLETIONS)

    @app.post(CHAT.path, response_model=None)
    async def chat_completions(request: Request) -> Response:
        return await handle_generation(request, state, chat)

    @app.post(responses.path, response_model=None)
    async def create_response(request: Request) -> Response:
        return await handle_generation(request, state, responses)

    # No response is stored (kvseal.server.responses), so none can be retrieved or cancelled:
    # 404 to any key, as vLLM answers without its store
    @app.get(responses.path + "/{response_id}", response_model=None)
    async def retrieve_response(response_id: str, request: Request) -> Response:
        return _no_stored_response(state, request, response_id)

    @app.post(responses.path + "/{response_id}/cancel", response_model=None)
    async def cancel_response(response_id: str, request: Request) -> Response:
        return _no_stored_response(state, request, response_id)


def _no_stored_response(state: AppState, request: Request, response_id: str) -> Response:
    try:
        state.keys.identify(authorization_of(request.headers))
    except ApiError as err:
        return errors.response(err)
    return errors.response(dataclasses.replace(response_not_found(clip(response_id)), param=None))


def _add_info_routes(app: FastAPI, state: AppState) -> None:
    @app.get("/v1/models", response_model=None)
    async def list_models(request: Request) -> Response:
        try:
            key = state.keys.identify(authorization_of(request.headers))
        except ApiError as err:
            return errors.response(err)
        return JSONResponse({"object": "list", "data": [_model_card(state, key.is_admin)]})

    @app.get("/v1/models/{model:path}", response_model=None)
    async def retrieve_model(model: str, request: Request) -> Response:
        if not model:  # GET /v1/models/: a trailing slash, answered as every other one (no model named '')
            return errors.response(errors.route_not_found(clip(request.url.path), served_routes(app)))
        try:
            key = state.keys.identify(authorization_of(request.headers))
            if model != state.model_name:
                raise errors.model_not_found(model, state.model_name)
        except ApiError as err:
            return errors.response(err)
        return JSONResponse(_model_card(state, key.is_admin))

    @app.get("/health", response_model=None)
    async def health() -> Response:
        return _health(state)

    # vLLM's /ping (SageMaker's health check, GET or POST): the same answer as /health
    @app.api_route("/ping", methods=["GET", "POST"], response_model=None)
    async def ping() -> Response:
        return _health(state)

    @app.get("/version", response_model=None)
    async def version(request: Request) -> Response:
        try:  # any key: which release runs is for clients, not for whoever reaches the port
            state.keys.identify(authorization_of(request.headers))
        except ApiError as err:
            return errors.response(err)
        return JSONResponse({"version": __version__})

    @app.get("/load", response_model=None)
    async def load(request: Request) -> Response:
        """vLLM's `{"server_load": N}`: the generation requests in the server now, from their
        key's check until they end. Every tenant's together, so an admin key's alone, as
        /metrics: a tenant must not watch another's traffic come and go."""
        try:
            state.keys.authenticate_admin(authorization_of(request.headers))
        except ApiError as err:
            return errors.response(err)
        return JSONResponse({"server_load": len(state.live_calls)})

    @app.get("/metrics", response_model=None)
    async def metrics(request: Request) -> Response:
        try:
            state.keys.authenticate_admin(authorization_of(request.headers))  # it lists every tenant
        except ApiError as err:
            return errors.response(err)
        state.metrics.engine_up.set(1 if state.engine.is_available else 0)
        state.metrics.record_scrub_mode(state.engine_info.kv_scrub_policy)  # PD: as the engines run now
        if state.engine.failure is not None:
            state.metrics.reset_engine_gauges()
        state.metrics.record_audit(state.audit.stats)
        state.metrics.record_model_enabled(state.model_name, state.model_name not in state.disabled_models)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _health(state: AppState) -> Response:
    if not state.engine.is_available or state.is_draining:
        return errors.response(errors.engine_unavailable(state.engine.failure or "the server is shutting down"))
    if state.audit.check() is not None:  # which retries a failing audit log once its back-off is over
        return errors.response(errors.audit_unavailable(state.audit))
    return JSONResponse({"status": "ok"})


def _model_card(state: AppState, is_admin: bool) -> dict[str, object]:
    """vLLM's card; an admin also sees whether the kill switch is on (`disabled`). `root` is the
    name the model was loaded under (its folder's or file's), never its path on the server."""
    card: dict[str, object] = {"id": state.model_name, "object": "model", "created": state.created,
                               "owned_by": "kvseal", "root": state.engine_info.model_name, "parent": None,
                               "max_model_len": state.engine_info.max_model_len,
                               "permission": [_model_permission(state)]}
    if is_admin:
        card["disabled"] = state.model_name in state.disabled_models
    return card


def _model_permission(state: AppState) -> dict[str, object]:
    """vLLM's (and OpenAI's old) permission entry, for clients that read it: what a key may do."""
    return {"id": f"modelperm-{state.model_name}", "object": "model_permission", "created": state.created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}


def served_routes(app: FastAPI) -> list[str]:
    """Every route the app serves, as "METHOD /path" (path parameters without their converters)."""
    return [f"{method} {route.path_format}" for route in app.routes if isinstance(route, Route)
            for method in sorted(route.methods or ()) if method != "HEAD"]


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            return errors.response(errors.route_not_found(clip(request.url.path), served_routes(app)))
        if exc.status_code == 405:
            return errors.response(errors.method_not_allowed(request.method, request.url.path))
        return errors.response(ApiError(exc.status_code, clip(str(exc.detail))))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return errors.response(ApiError(400, f"Invalid request: {exc.errors()[:3]}", code="invalid_parameter"))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> Response:
        logger.error("unhandled error on %s %s", request.method, clip(request.url.path), exc_info=exc)
        return errors.response(errors.internal_error())
