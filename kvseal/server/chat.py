"""`POST /v1/chat/completions`: messages in, an assistant message out.

The conversation is rendered with the model's own chat template, exactly as the offline
`LLM.chat` does.
"""

from __future__ import annotations

from typing import Any

from kvseal.admission import AdmissionLimits
from kvseal.errors import InvalidParameter
from kvseal.messages.msgs import RequestOutputMsg, TokenLogprobsMsg
from kvseal.server.auth import Tenant
from kvseal.server.endpoint import Prepared, ResponseIds
from kvseal.server.logprobs import chat_logprobs
from kvseal.server.prompts import PromptEncoder
from kvseal.server.protocol import ChatCompletionRequest
from kvseal.server.sampling import build_sampling_params
from kvseal.server.transcript import Transcript


class ChatEndpoint:
    path = "/v1/chat/completions"
    id_prefix = "chatcmpl"
    body_model = ChatCompletionRequest

    async def prepare(self, body: ChatCompletionRequest, prompts: PromptEncoder, tenant: Tenant,
                      limits: AdmissionLimits) -> Prepared:
        conversation = [m.as_template_input() for m in body.messages]
        ids = await prompts.chat_ids(conversation, tenant.name, limits, body.truncate_prompt_tokens is not None)
        params = build_sampling_params(body, max_tokens=_asked_max_tokens(body), num_prompt_tokens=len(ids),
                                       limits=limits, logprobs=_logprobs(body), tenant=tenant)
        return Prepared(ids, params, conversation)

    def formatter(self, body: ChatCompletionRequest, ids: ResponseIds, prompts: PromptEncoder) -> ChatFormatter:
        return ChatFormatter(ids, body.logprobs, body.include_usage, prompts)


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
    def __init__(self, ids: ResponseIds, with_logprobs: bool, include_usage: bool, prompts: PromptEncoder) -> None:
        self._ids = ids
        self._with_logprobs = with_logprobs
        self._include_usage = include_usage
        self._prompts = prompts

    def first_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""}, None, None)]

    def delta_chunk(self, out: RequestOutputMsg) -> dict[str, Any] | None:
        if not (out.new_text or out.finished or (self._with_logprobs and out.new_token_ids)):
            return None
        delta = {"content": out.new_text} if out.new_text else {}
        return self._chunk(delta, self._logprobs(out.logprobs or []), out.finish_reason if out.finished else None)

    def usage_chunk(self, transcript: Transcript) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk", []) | {"usage": transcript.usage()}

    def response(self, transcript: Transcript) -> dict[str, Any]:
        choice = {"index": 0, "message": {"role": "assistant", "content": transcript.text},
                  "logprobs": self._logprobs(transcript.logprobs), "finish_reason": transcript.finish_reason}
        return self._envelope("chat.completion", [choice]) | {"usage": transcript.usage()}

    def _chunk(self, delta: dict[str, Any], logprobs: dict[str, Any] | None,
               finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        chunk = self._envelope("chat.completion.chunk", [choice])
        return chunk | {"usage": None} if self._include_usage else chunk

    def _logprobs(self, lps: list[TokenLogprobsMsg]) -> dict[str, Any] | None:
        if not self._with_logprobs:
            return None
        return chat_logprobs(lps, self._prompts.token_text, self._prompts.token_bytes)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        ids = self._ids
        return {"id": ids.request_id, "object": obj, "created": ids.created, "model": ids.model, "choices": choices}
