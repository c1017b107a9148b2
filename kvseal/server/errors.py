"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

`ApiError` is the one exception the HTTP layer turns into a response. Every constructor
below says what was wrong, the limit, and what to do. Engine-side `RequestRejected` values
keep their own code, param and status.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from kvseal._testing.faults import Fault, is_active
from kvseal.engine_api import RESTART_THE_SERVER, EngineGone, RequestEvent, isolation_failure
from kvseal.errors import RequestRejected
from kvseal.messages.msgs import (
    ABORT_KEY_REVOKED,
    ABORT_MODEL_DISABLED,
    ABORT_SERVER_SHUTDOWN,
    RequestOutputMsg,
    RequestRejectedMsg,
)
from kvseal.server.audit import AUDIT_UNAVAILABLE, AuditLog
from kvseal.types import (
    ENGINE_UNAVAILABLE,
    HANDOFF_FAILED,
    ISOLATION_CHECK_FAILED,
    NO_TOKEN_SATISFIES_CONSTRAINTS,
    no_token_param,
)


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    retry_after_s: int | None = None  # sent as Retry-After
    headers: dict[str, str] | None = None  # more headers (the x-ratelimit-* of a 429)
    detail: str | None = None  # a finer reason than `code` for metrics and the audit log

    def __str__(self) -> str:
        return self.message

    @property
    def reason(self) -> str:
        """The label for metrics and the audit log."""
        return self.detail or self.code or self.type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


REQUEST_ID_HEADER = "x-request-id"


def response(err: ApiError, request_id: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """`err` in OpenAI's shape; `headers` (a tenant's x-ratelimit-*) under the error's own."""
    headers = (headers or {}) | ({REQUEST_ID_HEADER: request_id} if request_id else {})
    headers |= err.headers or {}
    if err.retry_after_s is not None:
        headers["retry-after"] = str(err.retry_after_s)
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def from_rejected(exc: RequestRejected) -> ApiError:
    return ApiError(exc.http_status, exc.message, exc.error_type, exc.code, exc.param)


def missing_api_key() -> ApiError:
    return ApiError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key")


def invalid_api_key() -> ApiError:
    return ApiError(401, "Incorrect API key provided. Use a key from the server's --api-keys file.",
                    code="invalid_api_key")


def duplicate_authorization(num_headers: int) -> ApiError:
    return ApiError(400, f"The request has {num_headers} Authorization headers; send exactly one, "
                         f"'Authorization: Bearer <key>'.", code="duplicate_authorization")


def admin_required() -> ApiError:
    return ApiError(403, "This route needs an admin API key (an entry with \"admin\": true in the server's "
                         "--api-keys file).", type="permission_error", code="admin_key_required")


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(415, f"Unsupported Content-Type '{content_type[:64]}': send the body as JSON with "
                         f"'Content-Type: application/json'.", code="unsupported_media_type")


def model_not_found(model: str, served: str) -> ApiError:
    return ApiError(404, f"The model '{model[:256]}' does not exist. This server serves '{served}'.",
                    code="model_not_found", param="model")


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than {limit} bytes. Send a smaller request "
                         f"(the operator sets the limit with --max-body-bytes).", code="request_too_large")


def body_timeout(timeout_s: float) -> ApiError:
    return ApiError(408, f"The request body did not arrive within {timeout_s:g} s. Send the whole body at once "
                         f"(the operator sets the limit with --body-timeout-s).", code="request_timeout")


def body_too_complex(what: str, limit: int) -> ApiError:
    return ApiError(400, f"The request body holds {what}; a request may hold at most {limit}. Send a smaller one "
                         f"(a long conversation: join adjacent text parts into one, or split it across requests).",
                    code="body_too_complex")


def invalid_json(detail: str) -> ApiError:
    return ApiError(400, f"We could not parse the JSON body of your request ({detail}). Send a JSON object.",
                    code="invalid_json")


# A slot frees when one of the tenant's requests ends, which nothing here can foresee: a short
# wait before the client asks again (OpenAI's client honours Retry-After).
CONCURRENCY_RETRY_AFTER_S = 1


def concurrency_limit(tenant: str, limit: int, num_slots: int) -> ApiError:
    what = "a request" if num_slots == 1 else f"{num_slots} more (one per choice, n={num_slots})"
    return ApiError(429, f"Tenant '{tenant}' may have {limit} requests in flight, each choice of a request with n > 1 "
                         f"counting as one, and has no room for {what}. Retry when one finishes.",
                    type="rate_limit_error", code="rate_limit_exceeded", detail="concurrency_limit_exceeded",
                    retry_after_s=CONCURRENCY_RETRY_AFTER_S)


def concurrency_limit_never(tenant: str, limit: int, num_slots: int) -> ApiError:
    """A request with more choices than the tenant may have in flight at all: retrying cannot help."""
    return ApiError(429, f"Request too large for tenant '{tenant}': its {num_slots} choices (n for each prompt) "
                         f"count as {num_slots} requests in flight, and its limit is {limit}. Ask for fewer choices "
                         f"or send fewer prompts, or ask the operator "
                         f"for a higher limit.", type="rate_limit_error", code="rate_limit_exceeded",
                    detail="concurrency_limit_exceeded")


def rate_limit(tenant: str, kind: str, limit: int, num_requested: int, retry_after_s: int) -> ApiError:
    """Over the tenant's requests or tokens per minute (`server.rate_limits`)."""
    return ApiError(429, f"Rate limit reached for tenant '{tenant}' on {kind} per minute: limit {limit}, "
                         f"requested {num_requested}. Retry in {retry_after_s} s, or ask the operator for a higher "
                         f"limit.", type="rate_limit_error", code="rate_limit_exceeded",
                    retry_after_s=retry_after_s, detail=f"{kind}_per_minute_exceeded")


def rate_limit_never(tenant: str, kind: str, limit: int, num_requested: int) -> ApiError:
    """A request larger than the whole per-minute limit: retrying cannot help."""
    return ApiError(429, f"Request too large for tenant '{tenant}' on {kind} per minute: limit {limit}, requested "
                         f"{num_requested}. Send a smaller request (a shorter prompt), or ask the operator for a "
                         f"higher limit.", type="rate_limit_error", code="rate_limit_exceeded",
                    detail=f"{kind}_per_minute_exceeded")


def engine_unavailable(detail: str) -> ApiError:
    """No engine can take the request; "Retry later" unless it stays down until the server restarts."""
    advice = "" if RESTART_THE_SERVER in detail else " Retry later."
    return ApiError(503, f"The inference engine is unavailable: {detail}.{advice}",
                    type="service_unavailable", code=ENGINE_UNAVAILABLE)


def too_many_connections(max_connections: int) -> ApiError:
    """A connection past `--max-connections`, answered before its request is read."""
    return ApiError(503, f"The server holds its most open connections ({max_connections}, --max-connections); "
                         f"retry shortly, or reuse a connection (keep-alive).",
                    type="service_unavailable", code="too_many_connections", retry_after_s=1)


def audit_unavailable(audit: AuditLog) -> ApiError:
    """The audit log (I8) cannot be written: the server answers nothing it cannot record."""
    detail = audit.failure or "the request's line could not be written"
    return ApiError(503, f"The server cannot record this request in its audit log ({detail}), and it answers "
                         f"no request it cannot record. The operator has been alerted; retry in "
                         f"{audit.retry_after_s} s.", type="service_unavailable", code=AUDIT_UNAVAILABLE,
                    retry_after_s=audit.retry_after_s)


def model_disabled(model: str) -> ApiError:
    """The operator's kill switch is on for `model` (`POST /admin/models/{id}/disable`)."""
    return ApiError(503, f"The model '{model}' is disabled by the server's operator; requests for it are refused "
                         f"until it is enabled again.", type="service_unavailable", code=ABORT_MODEL_DISABLED)


def key_revoked() -> ApiError:
    """The request's API key was removed or revoked while the request ran, and the operator
    asked for its requests to end (`?abort=true`)."""
    return ApiError(401, "The API key of this request was revoked by the server's operator while the request "
                         "ran; the request was stopped (a stream ends here; an answer not yet sent is not sent).",
                    code=ABORT_KEY_REVOKED)


def stopped_by_operator(reason: str) -> ApiError:
    """The error for a request the operator ended (`Call.stop`) with `reason`."""
    return key_revoked() if reason == ABORT_KEY_REVOKED else model_disabled_in_flight()


def model_disabled_in_flight() -> ApiError:
    return ApiError(503, "The model was disabled by the server's operator while this request ran; the request was "
                         "stopped (a stream ends here; an answer not yet sent is not sent).",
                    type="service_unavailable", code=ABORT_MODEL_DISABLED)


def invalid_keys_file(detail: str) -> ApiError:
    return ApiError(400, f"The API keys file was not reloaded; the keys in use are unchanged. {detail}",
                    code="invalid_keys_file")


def no_keys_file() -> ApiError:
    return ApiError(400, "This server was started without --api-keys: there is no keys file to reload. Restart it "
                         "with --api-keys FILE to use API keys.", code="no_keys_file")


def repeated_abort_param(num_values: int) -> ApiError:
    return ApiError(400, f"'abort' was given {num_values} times; give it once (true or false).",
                    code="invalid_parameter", param="abort")


def invalid_abort_param(value: str) -> ApiError:
    return ApiError(400, f"'abort' must be true or false, got '{value[:32]}'.", code="invalid_parameter",
                    param="abort")


def invalid_tenant_name(num_chars: int, max_chars: int) -> ApiError:
    return ApiError(400, f"The tenant name in the path has {num_chars} characters; it must have 1 to {max_chars}. "
                         f"Name the tenant as the keys file does.", code="invalid_parameter", param="tenant")


def admin_body_refused() -> ApiError:
    return ApiError(400, "Admin routes take no request body: their one option goes in the query string "
                         "(?abort=true). Send the request without a body.", code="invalid_request_body")


def admin_params_refused(names: list[str], allowed: list[str]) -> ApiError:
    takes = f"takes only {', '.join(repr(a) for a in allowed)}" if allowed else "takes no query parameters"
    return ApiError(400, f"Unknown query parameters {', '.join(repr(n[:32]) for n in names[:8])}: this admin route "
                         f"{takes}.", code="invalid_parameter", param=names[0][:32])


def browser_request_refused() -> ApiError:
    return ApiError(403, "Admin routes do not answer requests a web browser sends on a page's behalf (this one "
                         "carries an Origin or Sec-Fetch-Site header): call them from a tool such as curl.",
                    type="permission_error", code="browser_request_refused")


def abort_only_on_disable() -> ApiError:
    return ApiError(400, "'abort' applies only to disable: enabling the model ends no request. Send the enable "
                         "call without abort=true.", code="invalid_parameter", param="abort")


def handoff_failed(detail: str) -> ApiError:
    """PD: decode ended the request before its first token because the KV handoff failed (its
    prefill engine gave no sign of progress within --reservation-timeout-s): the server's failure."""
    return ApiError(503, f"The KV handoff between the prefill and decode engines failed: {detail}. Retry the "
                         f"request.", type="service_unavailable", code=HANDOFF_FAILED)


def request_aborted(detail: str) -> ApiError:
    """An admitted request the engine ended early: an error, never a success (I6)."""
    return ApiError(500, f"The request was aborted by the server: {detail}", type="server_error",
                    code="request_aborted")


def isolation_check_failed() -> ApiError:
    """The server refused to answer because an isolation check tripped; never the client's fault.
    The details stay in the server's log and audit record, not in the response."""
    return ApiError(500, "The server stopped this request because an isolation check failed; no output was "
                         "returned. The operator has been alerted (audit outcome isolation_violation).",
                    type="server_error", code=ISOLATION_CHECK_FAILED)


def route_not_found(path: str, routes: list[str]) -> ApiError:
    """`routes`: every route the server serves, as "METHOD /path"."""
    return ApiError(404, f"No route {path}. Routes: {', '.join(routes)}.", code="not_found")


def method_not_allowed(method: str, path: str) -> ApiError:
    return ApiError(405, f"Method {method} is not allowed on {path}.", code="method_not_allowed")


def internal_error() -> ApiError:
    return ApiError(500, "The server failed while handling this request; it has been logged.",
                    type="server_error", code="internal_error")


def _error_status(status: int) -> int:
    """An engine's refusal as an HTTP error status: a PD decode engine relays prefill's word, and
    a refusal must never reach the client as a success (I6), whatever a broken peer sent."""
    return status if 400 <= status <= 599 else 500


def _type_of(status: int) -> str:
    """OpenAI's error type for an engine's refusal: the client's fault below 500, else the server's."""
    if status < 500:
        return "invalid_request_error"
    return "service_unavailable" if status == 503 else "server_error"


def for_event(event: RequestEvent) -> ApiError | None:
    """The error a request event means for the client, or None for a successful output."""
    if isinstance(event, RequestRejectedMsg):
        status = _error_status(event.http_status)
        return ApiError(status, event.message, _type_of(status), code=event.code, param=event.param)
    if isinstance(event, EngineGone):
        return engine_unavailable(event.message)
    if isolation_failure(event) is not None:
        return isolation_check_failed()
    assert isinstance(event, RequestOutputMsg)
    if event.finish_reason != "abort" or is_active(Fault.ABORT_AS_SUCCESS):
        return None
    if event.error_code == NO_TOKEN_SATISFIES_CONSTRAINTS:  # the request's own constraints: the client's to fix
        return ApiError(400, event.error or "no token satisfies the request's constraints",
                        code=NO_TOKEN_SATISFIES_CONSTRAINTS, param=no_token_param(event.error))
    # the operator's and shutdown's aborts first: decode reports an abort it could only finish later
    # (KV still landing) with the handoff's code, but the reason is theirs
    if event.error == ABORT_SERVER_SHUTDOWN:
        return engine_unavailable("the server is shutting down")
    if event.error in (ABORT_KEY_REVOKED, ABORT_MODEL_DISABLED):
        return stopped_by_operator(event.error)
    if event.error_code == HANDOFF_FAILED:
        return handoff_failed(event.error or "no reason given")
    return request_aborted(event.error or "no reason given")
