"""`POST /v1/completions`: prompt in, text out (OpenAI's legacy completions shape).

`echo` puts the prompt before each choice's text (the prompt as sent, or the admitted token ids
decoded where they are what was sent or a prompt was truncated); with `logprobs` the prompt's
logprobs come first too (its first token without one), as OpenAI and vLLM give them, and with
`max_tokens` 0 the prompt alone comes back (one token is still generated, and counted, as in
vLLM). vLLM's `prompt_logprobs` adds each choice's `prompt_logprobs` list. `max_tokens` left
out is 16, as in OpenAI's and vLLM's API (cut to the rest of the context, where vLLM refuses);
sent as null it is the model's `max_new_tokens`, or the rest of the context.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvseal.admission import AdmissionLimits
from kvseal.errors import InvalidParameter
from kvseal.generation_defaults import GenerationDefaults
from kvseal.messages.msgs import RequestOutputMsg, TokenLogprobsMsg
from kvseal.server.auth import Tenant
from kvseal.server.endpoint import AdmittedPrompt, AuditPrompt, Prepared, ResponseIds
from kvseal.server.logprobs import (
    TextOffsets,
    completion_logprobs,
    echoed_prompt_logprobs,
    joined_logprobs,
    vllm_prompt_logprobs,
)
from kvseal.server.prompts import PromptEncoder, prompt_list
from kvseal.server.protocol import COMPLETION_MAX_TOKENS, CompletionRequest
from kvseal.server.sampling import build_sampling_params
from kvseal.server.transcript import Transcript, api_stop_reason, usage
from kvseal.types import SamplingParams


class CompletionsEndpoint:
    path = "/v1/completions"
    id_prefix = "cmpl-"
    body_model = CompletionRequest

    async def prepare(self, body: CompletionRequest, prompts: PromptEncoder, tenant: Tenant,
                      limits: AdmissionLimits, defaults: GenerationDefaults) -> Prepared:
        if body.max_tokens == 0 and not body.echo:
            raise InvalidParameter("max_tokens=0 asks for no output: it is allowed only with echo=true (the prompt "
                                   "alone comes back); ask for at least 1 token", param="max_tokens")
        ids = await prompts.completion_prompts(body.prompt, tenant.name, limits,
                                               body.truncate_prompt_tokens is not None, body.add_special_tokens)
        prompt_logprobs = body.logprobs if body.prompt_logprobs is None and body.echo else body.prompt_logprobs
        sent = "max_tokens" in body.model_fields_set  # sent as null: the defaults' (max_new_tokens, or the rest)
        if not sent:  # left out: OpenAI's and vLLM's 16, a default like max_new_tokens (the context still cuts it)
            defaults = dataclasses.replace(defaults, max_tokens=COMPLETION_MAX_TOKENS)
        params = [build_sampling_params(body, max_tokens=1 if _echo_only(body) else body.max_tokens if sent else None,
                                        num_prompt_tokens=len(one), limits=limits, logprobs=body.logprobs,
                                        tenant=tenant, defaults=defaults, prompt_logprobs=prompt_logprobs)
                  for one in ids]
        texts = [p for p in prompt_list(body.prompt) if isinstance(p, str)]
        audit_prompt: AuditPrompt = (texts[0] if isinstance(body.prompt, str) else texts) if texts else \
            (ids[0] if len(ids) == 1 else ids)
        return Prepared(ids, params, audit_prompt)

    async def formatter(self, body: CompletionRequest, ids: ResponseIds, prompts: PromptEncoder,
                        admitted: list[AdmittedPrompt]) -> CompletionFormatter:
        echoes = []
        if body.echo:
            sent = prompt_list(body.prompt)
            for text, prompt in zip(sent, admitted):
                echo_text = text if isinstance(text, str) and body.truncate_prompt_tokens is None else \
                    await prompts.decode(prompt.token_ids, prompt.tenant)
                echoes.append(Echo(prompt.token_ids, echo_text, _echo_only(body)))
        return CompletionFormatter(ids, body.logprobs is not None, body.include_usage, prompts, echoes,
                                   body.prompt_logprobs is not None, body.n or 1)


def _echo_only(body: CompletionRequest) -> bool:
    return body.echo and body.max_tokens == 0


@dataclass(frozen=True)
class Echo:
    """What an echoing request puts before each choice; `only`: nothing else (max_tokens 0)."""

    token_ids: list[int]
    text: str
    only: bool


class CompletionFormatter:
    """Choice `index` of a request of several prompts is choice `index % n` of prompt `index // n`
    (OpenAI's order); each prompt's choices echo that prompt."""

    def __init__(self, ids: ResponseIds, with_logprobs: bool, include_usage: bool, prompts: PromptEncoder,
                 echoes: list[Echo] | None = None, with_prompt_logprobs: bool = False,
                 choices_per_prompt: int = 1) -> None:
        self._ids = ids
        self._with_logprobs = with_logprobs
        self._include_usage = include_usage
        self._prompts = prompts
        self._echoes = echoes or []
        self._n = choices_per_prompt
        self._with_prompt_logprobs = with_prompt_logprobs  # vLLM's per-choice list (never streamed)
        self._offsets: dict[int, TextOffsets] = {}  # per choice, across the whole stream
        self._echoed: set[int] = set()  # the choices whose stream has sent the prompt

    def first_chunks(self) -> list[dict[str, Any]]:
        return []

    def _echo(self, index: int) -> Echo | None:
        return self._echoes[index // self._n] if self._echoes else None

    def delta_chunks(self, index: int, out: RequestOutputMsg) -> list[dict[str, Any]]:
        echo = self._echo(index)
        if echo is not None and index not in self._echoed and (out.new_token_ids or out.finished):
            return self._echo_chunks(index, out, echo)
        # a step's tokens whose text is held back (a stop string's prefix) or empty (a special token)
        # get a chunk too, as vLLM's: one chunk per step that made tokens
        if (echo is not None and echo.only) or not (out.new_text or out.finished or out.new_token_ids):
            return []
        logprobs = self._logprobs(index, out.logprobs or [])
        return [self._chunk(_choice(index, out.new_text, logprobs, out.finish_reason if out.finished else None,
                                    api_stop_reason(out)))]

    def _echo_chunks(self, index: int, out: RequestOutputMsg, echo: Echo) -> list[dict[str, Any]]:
        """A stream's first chunk of a choice: the prompt, then (unless echo only) its first output."""
        self._echoed.add(index)
        text, logprobs = echo.text, self._echo_logprobs(index, echo, out.prompt_logprobs)
        if not echo.only:
            text += out.new_text
            if logprobs is not None:
                logprobs = joined_logprobs(logprobs, self._logprobs(index, out.logprobs or []) or {})
        finish_reason = out.finish_reason if out.finished else None
        return [self._chunk(_choice(index, text, logprobs, finish_reason, api_stop_reason(out)))]

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope([choice])
        return chunk | {"usage": None} if self._include_usage else chunk

    def usage_chunk(self, transcripts: list[Transcript]) -> dict[str, Any]:
        return self._envelope([]) | {"usage": usage(transcripts, self._n)}

    def response(self, transcripts: list[Transcript]) -> dict[str, Any]:
        return self._envelope([self._response_choice(i, t) for i, t in enumerate(transcripts)]) | {
            "usage": usage(transcripts, self._n)}

    def engine_params(self, params: SamplingParams) -> SamplingParams:
        """As the request gave them: a completion's text is returned whole, reasoning included."""
        return params

    def _response_choice(self, index: int, transcript: Transcript) -> dict[str, Any]:
        echo = self._echo(index)
        text, logprobs = transcript.text, None
        if echo is not None:
            logprobs = self._echo_logprobs(index, echo, transcript.prompt_logprobs)
            text = echo.text if echo.only else echo.text + text
        if not (echo is not None and echo.only):
            output = self._logprobs(index, transcript.logprobs)
            logprobs = output if logprobs is None or output is None else joined_logprobs(logprobs, output)
        choice = _choice(index, text, logprobs, transcript.finish_reason, transcript.stop_reason)
        if self._with_prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(transcript.prompt_logprobs or [],
                                                             self._prompts.token_text)
        return choice

    def _echo_logprobs(self, index: int, echo: Echo, lps: list[TokenLogprobsMsg | None] | None
                       ) -> dict[str, Any] | None:
        """The echoed prompt's logprobs (None unless the request asked for logprobs)."""
        if not self._with_logprobs:
            return None
        offsets = self._offsets.setdefault(index, TextOffsets(self._prompts.token_bytes))
        return echoed_prompt_logprobs(echo.token_ids, lps or [], self._prompts.token_text, offsets)

    def _logprobs(self, index: int, lps: list[TokenLogprobsMsg]) -> dict[str, Any] | None:
        if not self._with_logprobs:
            return None
        offsets = self._offsets.setdefault(index, TextOffsets(self._prompts.token_bytes))
        return completion_logprobs(lps, self._prompts.token_text, offsets)

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        ids = self._ids
        return {"id": ids.request_id, "object": "text_completion", "created": ids.created, "model": ids.model,
                "choices": choices}


def _choice(index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None,
            stop_reason: str | int | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}
