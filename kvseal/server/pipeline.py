"""The one path every generation request takes, in this order:

API key → tenant (401) → not shutting down (503) → tenant requests per minute (429) → JSON
content type (415) → body within its size (413) and time (408) → a token-id list that cannot
fit (400, pre-scanned before the full parse) → valid body, every field within its bound (400;
a big body parsed off the event loop, fair across tenants: `body.BodyParser`) → served model
(404) → model not disabled by the operator (503 `model_disabled`) → chat: tool definitions and
tool-call arguments that a prompt could hold (400) → tenant concurrency slot (429) → a prompt
that cannot fit (400, before tokenizing) → tokenize (fair across tenants) → `admit` with the
engine's limits (I1, 400 `context_length_exceeded`) → an audit log that can be written (503
`audit_unavailable`, I8) → not stopped by the operator meanwhile (key revoked 401, model
disabled 503) → tenant tokens per minute, for the prompt (429) → engine → stream or JSON.

Every authenticated request counts against its tenant's requests per minute as it arrives,
before its body is read, as OpenAI counts requests (refused ones too): a tenant cannot make the
server read and parse bodies without limit by sending ones it knows will be refused. Only the
server's own refusals (5xx) give the request back (`Call.reject`).

The tenant's limits are read again once the body is in (`Call.take_current_limits`): a keys
reload while it arrived applies to this request too, as to any request sent after it.

Nothing is sent to the engine before `admit` accepted the request; a refusal is terminal and
leaves its audit record. Whatever happens after submission, the request ends in the engine
too (abort on disconnect or shutdown) before its slot is given back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from kvseal.engine_api import EngineUnavailable
from kvseal.errors import ContextLengthExceeded, RequestRejected
from kvseal.messages.convert import params_to_msg
from kvseal.messages.msgs import ABORT_CLIENT_DISCONNECTED, AddRequestMsg
from kvseal.server import errors
from kvseal.server.auth import authorization_of
from kvseal.server.body import read_body, require_json
from kvseal.server.bounds import check_message_extras
from kvseal.server.call import Call
from kvseal.server.choices import ChoiceGroup
from kvseal.server.collect import respond_when_done
from kvseal.server.endpoint import AdmittedPrompt, Endpoint, Formatter, ResponseIds
from kvseal.server.errors import ApiError
from kvseal.server.features import features_used
from kvseal.server.front_door import admit_at_the_door
from kvseal.server.prompts import check_token_list_before_parsing, prompt_list
from kvseal.server.protocol import ChatCompletionRequest, CompletionRequest, GenerationBody
from kvseal.server.response_format import with_structured_output
from kvseal.server.state import AppState
from kvseal.server.streaming import EventStreamResponse
from kvseal.types import SamplingParams

logger = logging.getLogger("kvseal.server")


async def handle_generation(request: Request, state: AppState, endpoint: Endpoint) -> Response:
    call = Call(state, endpoint.path, f"{endpoint.id_prefix}{uuid.uuid4().hex}")
    try:
        body, fmt, handle = await _admit_and_submit(request, state, endpoint, call)
    except ApiError as err:
        return _refuse(call, err)
    except RequestRejected as exc:
        if isinstance(exc, ContextLengthExceeded):
            call.num_prompt_tokens = exc.num_prompt_tokens
        return _refuse(call, errors.from_rejected(exc))
    except EngineUnavailable as exc:
        return _refuse(call, errors.engine_unavailable(str(exc)))
    except ClientDisconnect:  # gone while sending its body: nothing reached the engine
        call.abandon(ABORT_CLIENT_DISCONNECTED)
        return Response(status_code=400)
    except asyncio.CancelledError:  # the server stopped waiting for this request (shutdown)
        call.reject(errors.engine_unavailable("the server is shutting down"))
        raise
    except Exception:
        logger.exception("request %s failed before reaching the engine", call.request_id)
        return _refuse(call, errors.internal_error())
    if body.stream:
        return EventStreamResponse(call, handle, fmt, body.include_usage, body.include_continuous_usage)
    return await respond_when_done(request, call, handle, fmt)


def _refuse(call: Call, err: ApiError) -> JSONResponse:
    call.reject(err)
    return errors.response(err, call.request_id, call.rate_headers())


async def _admit_and_submit(request: Request, state: AppState, endpoint: Endpoint,
                            call: Call) -> tuple[GenerationBody, Formatter, ChoiceGroup]:
    key = state.keys.identify(authorization_of(request.headers))
    call.authenticated(key)
    if state.is_draining:
        raise errors.engine_unavailable("the server is shutting down")
    call.take_request()
    require_json(request)
    data = await read_body(request, state.config.max_body_bytes, state.config.body_timeout_s)
    tenant = call.take_current_limits()  # a reload may have come while the body did
    check_token_list_before_parsing(data, state.limits)
    body = await state.bodies.parse(endpoint.body_model, data, tenant.name)
    call.model, call.user, call.features = body.model, body.user, features_used(body)
    if body.model is not None and body.model != state.model_name:
        raise errors.model_not_found(body.model, state.model_name)
    if state.model_name in state.disabled_models:
        raise errors.model_disabled(state.model_name)
    if isinstance(body, ChatCompletionRequest):
        check_message_extras(body.messages, state.limits, state.prompts.max_token_chars, body.conversation_names)
    call.take_slots(tenant, (body.n or 1) * num_prompts(body))
    prepared = await endpoint.prepare(body, state.prompts, tenant, state.limits, state.defaults)
    call.prompt_for_audit = prepared.prompt_for_audit
    call.num_prompt_tokens = sum(len(ids) for ids in prepared.prompt_token_ids)
    prompts = [admit_at_the_door(ids, params, state.limits)  # I1, every prompt before any is submitted
               for ids, params in zip(prepared.prompt_token_ids, prepared.params)]
    call.num_prompt_tokens = sum(len(ids) for ids in prompts)
    params = await _with_structured_output(prepared.params, body)
    fmt = await endpoint.formatter(body, ResponseIds(call.request_id, state.model_name, int(time.time())),
                                   state.prompts, [AdmittedPrompt(ids, tenant.name) for ids in prompts])
    msgs = [AddRequestMsg(call.request_id, tenant.name, ids, params_to_msg(fmt.engine_params(p)))
            for ids, p in zip(prompts, params)]
    _require_audit(state)
    if call.stopped_by is not None:  # its key was revoked or the model disabled while it was prepared
        raise errors.stopped_by_operator(call.stopped_by)
    if not state.keys.holds(key):  # a reload (with or without ?abort) took its key while its body came in
        raise errors.key_revoked()
    call.take_prompt_tokens()  # last: a refusal after it would waste them
    return body, fmt, call.submit(msgs)  # nothing after this line may fail before the response owns the call


def num_prompts(body: GenerationBody) -> int:
    """How many prompts the request sends: each prompt's choices take the tenant's slots."""
    return len(prompt_list(body.prompt)) if isinstance(body, CompletionRequest) else 1


async def _with_structured_output(params: list[SamplingParams], body: GenerationBody) -> list[SamplingParams]:
    """Every prompt's parameters with the request's structured output (its spec checked once)."""
    first = await with_structured_output(params[0], body)
    return [first, *(dataclasses.replace(p, structured=first.structured) for p in params[1:])]


def _require_audit(state: AppState) -> None:
    """503 `audit_unavailable` while the audit log cannot be written (I8): nothing reaches the
    engine that could not be recorded. Checked last, so bad input stays a 4xx meanwhile."""
    if state.audit.check() is not None:
        raise errors.audit_unavailable(state.audit)
