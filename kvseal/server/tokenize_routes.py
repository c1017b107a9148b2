"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes, authenticated like every route.

/tokenize takes `{"prompt": str}` (tokenized as /v1/completions does) or `{"messages": [...]}`
(rendered with the chat template as /v1/chat/completions does, with `tools` if sent: the count
is the chat request's `prompt_tokens`) and answers
`{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` only with
`return_token_strs`). /detokenize takes `{"tokens": [int]}` and answers `{"prompt": str}`.
Neither touches the engine; both run the tokenizer on the frontend's tokenizer thread.

Both are bounded as prompts are: a /tokenize prompt that cannot fit the context is refused
before it is tokenized, and /detokenize takes at most as many ids as a prompt may have (a big
body is refused from a scan, before its ids are parsed). Every call leaves an audit record
(I8) with its token count, never its text or ids, and answers only once that line is written
(else 503 `audit_unavailable`; a refusal stays the refusal it was).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import pydantic_core
from fastapi import FastAPI
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvseal._testing.faults import Fault, is_active
from kvseal.admission import AdmissionLimits
from kvseal.errors import ContextLengthExceeded, InvalidParameter, RequestRejected
from kvseal.prompting import ChatOptions
from kvseal.server import errors
from kvseal.server.audit import AuditRecord, Outcome, clip_optional, key_id_of
from kvseal.server.auth import Tenant, authorization_of
from kvseal.server.body import parse_body, read_body, require_json
from kvseal.server.bounds import check_message_extras, check_tool_definitions
from kvseal.server.errors import ApiError
from kvseal.server.prompts import check_token_list_before_parsing, prescan_token_list
from kvseal.server.protocol import INT32_MAX, MAX_MESSAGES, MAX_NAME_CHARS, ChatMessage, TemplateKwargs, ToolDef, _Body
from kvseal.server.state import AppState
from kvseal.structured.schema import MAX_TOOLS

logger = logging.getLogger("kvseal.server")


class TokenizeCompletionBody(_Body):
    model: Annotated[str, Field(max_length=MAX_NAME_CHARS)] | None = None
    prompt: str
    return_token_strs: bool = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS and the like around the text


class TokenizeChatBody(_Body):
    model: Annotated[str, Field(max_length=MAX_NAME_CHARS)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: TemplateKwargs | None = None
    add_special_tokens: bool = False  # vLLM's: the template writes them
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None  # rendered as on chat completions


class DetokenizeBody(_Body):
    model: Annotated[str, Field(max_length=MAX_NAME_CHARS)] | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT32_MAX)]]  # at most the prompt limit (checked with it)


@dataclass
class TokenCall:
    """One /tokenize or /detokenize call, for its audit record: counts, never content."""

    endpoint: str
    request_id: str = field(default_factory=lambda: f"tok-{uuid.uuid4().hex}")
    received_at: float = field(default_factory=time.time)
    tenant: str | None = None
    key_id: str | None = None
    model: str | None = None
    num_tokens: int | None = None  # the ids /tokenize produced, or the ids /detokenize was sent

    def record(self, outcome: Outcome, err: ApiError | None = None) -> AuditRecord:
        return AuditRecord(
            request_id=self.request_id, endpoint=self.endpoint, tenant=self.tenant, outcome=outcome,
            received_at=self.received_at, finished_at=time.time(), http_status=err.status if err else None,
            model=clip_optional(self.model), reason=err.reason if err else None,
            rejected_by="frontend" if outcome == "rejected" else None, prompt_tokens=self.num_tokens,
            key_id=self.key_id)


Handler = Callable[[bytes, AppState, Tenant, TokenCall], Awaitable[dict[str, Any]]]


def add_tokenize_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/tokenize", response_model=None)
    async def tokenize(request: Request) -> Response:
        return await _answer(request, state, TokenCall("/tokenize"), _tokenize)

    @app.post("/detokenize", response_model=None)
    async def detokenize(request: Request) -> Response:
        return await _answer(request, state, TokenCall("/detokenize"), _detokenize)


async def _answer(request: Request, state: AppState, call: TokenCall, handler: Handler) -> Response:
    try:
        authorization = authorization_of(request.headers)
        tenant = state.keys.authenticate(authorization)
        call.tenant, call.key_id = tenant.name, None if state.keys.is_open else key_id_of(authorization)
        require_json(request)
        data = await read_body(request, state.config.max_body_bytes, state.config.body_timeout_s)
        check_token_list_before_parsing(data, state.limits)
        result = await handler(data, state, tenant, call)
    except ApiError as err:
        return _refuse(state, call, err)
    except RequestRejected as exc:
        if isinstance(exc, ContextLengthExceeded):
            call.num_tokens = exc.num_prompt_tokens
        return _refuse(state, call, errors.from_rejected(exc))
    except Exception:
        logger.exception("%s %s failed", call.endpoint, call.request_id)
        return _refuse(state, call, errors.internal_error())
    if not state.audit.write(call.record("finished")):  # no answer without its audit line (I8)
        return errors.response(errors.audit_unavailable(state.audit), call.request_id)
    return JSONResponse(result, headers={errors.REQUEST_ID_HEADER: call.request_id})


def _refuse(state: AppState, call: TokenCall, err: ApiError) -> Response:
    """A refusal is answered as it is, whether or not its audit line could be written now."""
    state.audit.write(call.record("rejected" if err.status < 500 else "error", err))
    return errors.response(err, call.request_id)


async def _tokenize(data: bytes, state: AppState, tenant: Tenant, call: TokenCall) -> dict[str, Any]:
    """A prompt that cannot fit the context is refused before tokenizing, as on the generation
    routes: tokenizing it would only let one tenant stall the tokenizer for every other."""
    body = await state.bodies.run(_tokenize_body, data, tenant.name)
    call.model = body.model
    _check_model(body.model, state)
    if isinstance(body, TokenizeChatBody):
        check_message_extras(body.messages, state.limits, state.prompts.max_token_chars)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        if tools is not None:  # no call is forced here: every schema gets the bounds checks only
            await check_tool_definitions(tools, frozenset(), state.limits, state.prompts.max_token_chars)
        options = ChatOptions.of(body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs,
                                 body.add_special_tokens)
        ids = await state.prompts.chat_ids([m.as_template_input() for m in body.messages], tenant.name,
                                           state.limits, may_truncate=False, tools=tools, options=options)
    else:
        ids = await state.prompts.completion_ids(body.prompt, tenant.name, state.limits, may_truncate=False,
                                                 add_special_tokens=body.add_special_tokens)
    call.num_tokens = len(ids)
    token_strs = state.prompts.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.engine_info.max_model_len, "tokens": ids,
            "token_strs": token_strs}


def _tokenize_body(data: bytes) -> TokenizeCompletionBody | TokenizeChatBody:
    """The chat shape when the body has `messages`, the prompt shape otherwise. The shape is
    sniffed with the parser `parse_body` uses (pydantic's), whose nesting limit makes a deep
    body a ValueError, so the sniff refuses what `parse_body` refuses, in its words."""
    try:
        raw = pydantic_core.from_json(data)
    except ValueError:
        raw = None  # parse_body below reports the JSON error in the usual shape
    if isinstance(raw, dict) and "messages" in raw:
        return parse_body(TokenizeChatBody, data)
    return parse_body(TokenizeCompletionBody, data)


async def _detokenize(data: bytes, state: AppState, tenant: Tenant, call: TokenCall) -> dict[str, Any]:
    _check_num_ids(call, prescan_token_list(data, "tokens"), state.limits)  # before parsing a big body
    body = await state.bodies.parse(DetokenizeBody, data, tenant.name)
    call.model = body.model
    _check_num_ids(call, len(body.tokens), state.limits)
    _check_model(body.model, state)
    vocab_size = state.engine_info.vocab_size
    bad = next((t for t in body.tokens if t >= vocab_size), None)
    if bad is not None:
        raise InvalidParameter(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="tokens")
    return {"prompt": await state.prompts.decode(body.tokens, tenant.name)}


def _check_num_ids(call: TokenCall, num_ids: int | None, limits: AdmissionLimits) -> None:
    """/detokenize takes at most as many ids as a prompt may have (`InvalidParameter`)."""
    if num_ids is None:
        return
    call.num_tokens = num_ids
    limit = limits.max_prompt_tokens
    if num_ids > limit and not is_active(Fault.SKIP_DOOR_CHECKS):
        raise InvalidParameter(f"tokens has {num_ids} token ids; /detokenize takes at most {limit}, the most a "
                               f"prompt may have on this server. Send fewer ids per call.", param="tokens")


def _check_model(model: str | None, state: AppState) -> None:
    if model is not None and model != state.model_name:
        raise errors.model_not_found(model, state.model_name)
