"""`POST /v1/completions`: prompt in, text out (OpenAI's legacy completions shape)."""

from __future__ import annotations

from typing import Any

from kvseal.admission import AdmissionLimits
from kvseal.messages.msgs import RequestOutputMsg, TokenLogprobsMsg
from kvseal.server.auth import Tenant
from kvseal.server.endpoint import Prepared, ResponseIds
from kvseal.server.generation_defaults import GenerationDefaults
from kvseal.server.logprobs import TextOffsets, completion_logprobs
from kvseal.server.prompts import PromptEncoder
from kvseal.server.protocol import CompletionRequest
from kvseal.server.sampling import build_sampling_params
from kvseal.server.transcript import Transcript, usage


class CompletionsEndpoint:
    path = "/v1/completions"
    id_prefix = "cmpl"
    body_model = CompletionRequest

    async def prepare(self, body: CompletionRequest, prompts: PromptEncoder, tenant: Tenant,
                      limits: AdmissionLimits, defaults: GenerationDefaults) -> Prepared:
        ids = await prompts.completion_ids(body.prompt, tenant.name, limits, body.truncate_prompt_tokens is not None)
        params = build_sampling_params(body, max_tokens=body.max_tokens, num_prompt_tokens=len(ids), limits=limits,
                                       logprobs=body.logprobs, tenant=tenant, defaults=defaults)
        audit_prompt = body.prompt if isinstance(body.prompt, str) else ids
        return Prepared(ids, params, audit_prompt)

    def formatter(self, body: CompletionRequest, ids: ResponseIds, prompts: PromptEncoder) -> CompletionFormatter:
        return CompletionFormatter(ids, body.logprobs is not None, body.include_usage, prompts)


class CompletionFormatter:
    def __init__(self, ids: ResponseIds, with_logprobs: bool, include_usage: bool, prompts: PromptEncoder) -> None:
        self._ids = ids
        self._with_logprobs = with_logprobs
        self._include_usage = include_usage
        self._prompts = prompts
        self._offsets: dict[int, TextOffsets] = {}  # per choice, across the whole stream

    def first_chunks(self) -> list[dict[str, Any]]:
        return []

    def delta_chunks(self, index: int, out: RequestOutputMsg) -> list[dict[str, Any]]:
        if not (out.new_text or out.finished or (self._with_logprobs and out.new_token_ids)):
            return []
        logprobs = self._logprobs(index, out.logprobs or [])
        chunk = self._envelope([_choice(index, out.new_text, logprobs, out.finish_reason if out.finished else None)])
        return [chunk | {"usage": None} if self._include_usage else chunk]

    def usage_chunk(self, transcripts: list[Transcript]) -> dict[str, Any]:
        return self._envelope([]) | {"usage": usage(transcripts)}

    def response(self, transcripts: list[Transcript]) -> dict[str, Any]:
        choices = [_choice(i, t.text, self._logprobs(i, t.logprobs), t.finish_reason)
                   for i, t in enumerate(transcripts)]
        return self._envelope(choices) | {"usage": usage(transcripts)}

    def _logprobs(self, index: int, lps: list[TokenLogprobsMsg]) -> dict[str, Any] | None:
        if not self._with_logprobs:
            return None
        offsets = self._offsets.setdefault(index, TextOffsets(self._prompts.token_bytes))
        return completion_logprobs(lps, self._prompts.token_text, offsets)

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        ids = self._ids
        return {"id": ids.request_id, "object": "text_completion", "created": ids.created, "model": ids.model,
                "choices": choices}


def _choice(index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
