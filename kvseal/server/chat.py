"""`POST /v1/chat/completions`: messages in, an assistant message out.

The conversation is rendered with the model's own chat template, exactly as the offline
`LLM.chat` does. Without `max_tokens`, a chat answer may use the rest of the context window
(capped by the tenant's `max_tokens`).
"""

from __future__ import annotations

from typing import Any

from kvseal.admission import AdmissionLimits
from kvseal.errors import InvalidParameter
from kvseal.messages.msgs import RequestOutputMsg, TokenLogprobsMsg
from kvseal.server.auth import Tenant
from kvseal.server.endpoint import Prepared, ResponseIds
from kvseal.server.generation_defaults import GenerationDefaults
from kvseal.server.logprobs import chat_logprobs
from kvseal.server.prompts import PromptEncoder
from kvseal.server.protocol import ChatCompletionRequest
from kvseal.server.sampling import build_sampling_params
from kvseal.server.transcript import Transcript, usage


class ChatEndpoint:
    path = "/v1/chat/completions"
    id_prefix = "chatcmpl"
    body_model = ChatCompletionRequest

    async def prepare(self, body: ChatCompletionRequest, prompts: PromptEncoder, tenant: Tenant,
                      limits: AdmissionLimits, defaults: GenerationDefaults) -> Prepared:
        conversation = [m.as_template_input() for m in body.messages]
        ids = await prompts.chat_ids(conversation)
        num_prompt_tokens = min(len(ids), body.truncate_prompt_tokens or len(ids))
        params = build_sampling_params(body, max_tokens=_asked_max_tokens(body),
                                       default_max_tokens=limits.max_model_len - num_prompt_tokens,
                                       logprobs=_logprobs(body), tenant=tenant, defaults=defaults)
        return Prepared(ids, params, conversation)

    def formatter(self, body: ChatCompletionRequest, ids: ResponseIds, prompts: PromptEncoder) -> ChatFormatter:
        return ChatFormatter(ids, body.logprobs, body.include_usage, prompts, body.n or 1)


def _asked_max_tokens(body: ChatCompletionRequest) -> int | None:
    if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
        raise InvalidParameter("max_tokens and max_completion_tokens disagree; send only max_completion_tokens",
                               param="max_completion_tokens")
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens


def _logprobs(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidParameter("top_logprobs requires logprobs=true", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


class ChatFormatter:
    def __init__(self, ids: ResponseIds, with_logprobs: bool, include_usage: bool, prompts: PromptEncoder,
                 num_choices: int = 1) -> None:
        self._ids = ids
        self._with_logprobs = with_logprobs
        self._include_usage = include_usage
        self._prompts = prompts
        self._num_choices = num_choices

    def first_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk(i, {"role": "assistant", "content": ""}, None, None) for i in range(self._num_choices)]

    def delta_chunks(self, index: int, out: RequestOutputMsg) -> list[dict[str, Any]]:
        if not (out.new_text or out.finished or (self._with_logprobs and out.new_token_ids)):
            return []
        delta = {"content": out.new_text} if out.new_text else {}
        logprobs = self._logprobs(out.logprobs or [])
        return [self._chunk(index, delta, logprobs, out.finish_reason if out.finished else None)]

    def usage_chunk(self, transcripts: list[Transcript]) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk", []) | {"usage": usage(transcripts)}

    def response(self, transcripts: list[Transcript]) -> dict[str, Any]:
        choices = [{"index": i, "message": {"role": "assistant", "content": t.text},
                    "logprobs": self._logprobs(t.logprobs), "finish_reason": t.finish_reason}
                   for i, t in enumerate(transcripts)]
        return self._envelope("chat.completion", choices) | {"usage": usage(transcripts)}

    def _chunk(self, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None,
               finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        chunk = self._envelope("chat.completion.chunk", [choice])
        return chunk | {"usage": None} if self._include_usage else chunk

    def _logprobs(self, lps: list[TokenLogprobsMsg]) -> dict[str, Any] | None:
        return chat_logprobs(lps, self._prompts.token_text) if self._with_logprobs else None

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        ids = self._ids
        return {"id": ids.request_id, "object": obj, "created": ids.created, "model": ids.model, "choices": choices}
