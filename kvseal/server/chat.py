"""`POST /v1/chat/completions`: messages in, an assistant message out.

The conversation is rendered with the model's own chat template, exactly as the offline
`LLM.chat` does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from kvseal.admission import AdmissionLimits
from kvseal.errors import InvalidParameter
from kvseal.generation_defaults import GenerationDefaults
from kvseal.messages.msgs import RequestOutputMsg, TokenLogprobsMsg
from kvseal.server.auth import Tenant
from kvseal.server.bounds import check_tool_definitions
from kvseal.server.endpoint import AdmittedPrompt, Prepared, ResponseIds
from kvseal.server.logprobs import chat_logprobs, vllm_prompt_logprobs
from kvseal.server.prompts import PromptEncoder
from kvseal.server.protocol import ChatCompletionRequest, NamedToolChoice
from kvseal.server.reasoning import ReasoningMarkers, ReasoningStream, prompt_opens_reasoning, split_reasoning
from kvseal.server.sampling import build_sampling_params
from kvseal.server.tools import ParsedToolCall, ToolCallStream, ToolParser, tool_parser, tool_setup
from kvseal.server.transcript import Transcript, api_stop_reason, usage
from kvseal.types import ReasoningGate, SamplingParams


class ChatEndpoint:
    path = "/v1/chat/completions"
    id_prefix = "chatcmpl-"
    body_model = ChatCompletionRequest

    def __init__(self, tool_call_parser: str | None = None, reasoning: ReasoningMarkers | None = None) -> None:
        self.tool_call_parser = tool_call_parser  # one of TOOL_CALL_PARSERS, or None (requests with tools refused)
        self.reasoning = reasoning  # the model's <think> tokens with a reasoning parser, else None (no split)

    async def prepare(self, body: ChatCompletionRequest, prompts: PromptEncoder, tenant: Tenant,
                      limits: AdmissionLimits, defaults: GenerationDefaults) -> Prepared:
        tools = tool_setup(body, self.tool_call_parser)
        if tools.definitions is not None:
            await check_tool_definitions(tools.definitions, tools.grammar_tools, limits, prompts.max_token_chars)
        conversation = [m.as_template_input() for m in body.messages]
        ids = await prompts.chat_ids(conversation, tenant.name, limits, body.truncate_prompt_tokens is not None,
                                     tools.definitions, body.chat_options)
        params = build_sampling_params(body, max_tokens=_asked_max_tokens(body), num_prompt_tokens=len(ids),
                                       limits=limits, logprobs=_logprobs(body), tenant=tenant, defaults=defaults,
                                       max_tokens_param=_max_tokens_param(body), prompt_logprobs=body.prompt_logprobs)
        if tools.grammar is not None:
            params = dataclasses.replace(params, structured=tools.grammar)
        return Prepared([ids], [params], conversation)

    async def formatter(self, body: ChatCompletionRequest, ids: ResponseIds, prompts: PromptEncoder,
                        admitted: list[AdmittedPrompt]) -> ChatFormatter:
        parses_calls = bool(body.tools) and body.tool_choice != "none" and self.tool_call_parser is not None
        is_named = isinstance(body.tool_choice, NamedToolChoice)
        reasoning = None
        if self.reasoning is not None:  # does the prompt leave a <think> block open?
            tail = await prompts.decode(admitted[0].token_ids[-PROMPT_TAIL_TOKENS:], admitted[0].tenant)
            markers = self.reasoning
            reasoning = ReasoningGate(markers.start_token_id, markers.end_token_id, prompt_opens_reasoning(tail))
        return ChatFormatter(ids, body.logprobs, body.include_usage, prompts, body.n or 1,
                             tool_parser(self.tool_call_parser, body.parallel_tool_calls is not False, body.tools)
                             if parses_calls and self.tool_call_parser else None,
                             is_named,
                             with_prompt_logprobs=body.prompt_logprobs is not None, reasoning=reasoning,
                             include_reasoning=body.include_reasoning, echo=_echo(body))


PROMPT_TAIL_TOKENS = 16  # the prompt's last tokens, read for an open <think>


def _echo(body: ChatCompletionRequest) -> str:
    """vLLM's `echo`: the text the answer starts with, the last message's content when that
    message is the answer's own turn (an assistant's, or any last message the template continues
    without a generation prompt); "" otherwise."""
    last = body.messages[-1]
    if not body.echo or (body.add_generation_prompt and last.role != "assistant"):
        return ""
    return str(last.as_template_input()["content"])


def _asked_max_tokens(body: ChatCompletionRequest) -> int | None:
    if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
        raise InvalidParameter("max_tokens and max_completion_tokens disagree; send only max_completion_tokens",
                               param="max_completion_tokens")
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens


def _max_tokens_param(body: ChatCompletionRequest) -> str:
    """The field the client asked for its output length in, for the errors about it."""
    return "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"


def _logprobs(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidParameter("top_logprobs requires logprobs=true", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def _reasoning_fields(reasoning: str) -> dict[str, str]:
    """vLLM's `reasoning`, and `reasoning_content`, the name clients of its earlier releases read."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


class ChatFormatter:
    def __init__(self, ids: ResponseIds, with_logprobs: bool, include_usage: bool, prompts: PromptEncoder,
                 num_choices: int = 1, tool_parser: ToolParser | None = None,
                 is_named_tool: bool = False, with_prompt_logprobs: bool = False,
                 reasoning: ReasoningGate | None = None, include_reasoning: bool = True, echo: str = "") -> None:
        """`reasoning`: None without a reasoning parser; else the model's markers, and whether
        the prompt left a `<think>` block open (`server/reasoning.py`). `include_reasoning`
        false: the reasoning is split off as usual but not sent (vLLM's field). `echo`: the text
        every choice's content starts with (`_echo`), sent after the role in a stream."""
        self._ids = ids
        self._with_logprobs = with_logprobs
        self._include_usage = include_usage
        self._prompts = prompts
        self._num_choices = num_choices
        self._tool_parser = tool_parser
        self._is_named_tool = is_named_tool  # OpenAI ends a forced call with "stop", an auto one with "tool_calls"
        self._tool_streams: dict[int, ToolCallStream] = {}
        self._with_prompt_logprobs = with_prompt_logprobs  # vLLM's: one list for the response (never streamed)
        self._reasoning = reasoning
        self._include_reasoning = include_reasoning
        self._reasoning_streams: dict[int, ReasoningStream] = {}
        self._echo = echo

    @property
    def reasoning_gate(self) -> ReasoningGate | None:
        """The model's reasoning markers and whether the prompt left the block open (None
        without a reasoning parser)."""
        return self._reasoning

    def engine_params(self, params: SamplingParams) -> SamplingParams:
        """A structured output constrains the answer this formatter splits from the reasoning:
        its grammar waits for the reasoning block's end, from the same start as the split."""
        if self._reasoning is None or params.structured is None:
            return params
        return dataclasses.replace(params, structured=dataclasses.replace(params.structured, reasoning=self._reasoning))

    def first_chunks(self) -> list[dict[str, Any]]:
        chunks = [self._chunk(i, {"role": "assistant", "content": ""}, None, None) for i in range(self._num_choices)]
        if self._echo:
            chunks += [self._chunk(i, {"content": self._echo}, None, None) for i in range(self._num_choices)]
        return chunks

    def delta_chunks(self, index: int, out: RequestOutputMsg) -> list[dict[str, Any]]:
        if self._reasoning is None:
            return self._content_chunks(index, out)
        stream = self._reasoning_streams.setdefault(index, ReasoningStream(self._reasoning.open_at_start))
        reasoning, content = stream.feed(out.new_text)
        if out.finished:
            more_reasoning, more_content = stream.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if reasoning and not content and not out.finished:  # the step's tokens are all reasoning: one chunk
            logprobs = self._logprobs(out.logprobs or [])  # carries them (None without logprobs)
            if self._include_reasoning:
                return [self._chunk(index, _reasoning_fields(reasoning), logprobs, None)]
            return [self._chunk(index, {}, logprobs, None)] if logprobs is not None else []
        chunks = [self._chunk(index, _reasoning_fields(reasoning), None, None)] \
            if reasoning and self._include_reasoning else []
        return chunks + self._content_chunks(index, msgspec.structs.replace(out, new_text=content))

    def _content_chunks(self, index: int, out: RequestOutputMsg) -> list[dict[str, Any]]:
        if self._tool_parser is not None:
            return self._tool_delta_chunks(index, out)
        if not (out.new_text or out.finished or out.new_token_ids):  # a step's tokens whose text is held
            return []  # back or empty get a chunk too, as vLLM's: one chunk per step that made tokens
        delta = {"content": out.new_text} if out.new_text else {}
        logprobs = self._logprobs(out.logprobs or [])
        return [self._chunk(index, delta, logprobs, out.finish_reason if out.finished else None,
                            api_stop_reason(out))]

    def _tool_delta_chunks(self, index: int, out: RequestOutputMsg) -> list[dict[str, Any]]:
        assert self._tool_parser is not None
        stream = self._tool_streams.setdefault(index, ToolCallStream(self._tool_parser))
        step = stream.feed(out.new_text)
        logprobs = self._logprobs(out.logprobs or []) if out.new_token_ids else None
        delta: dict[str, Any] = {"content": step.content} if step.content or (logprobs and not step.calls) else {}
        if step.calls:
            delta["tool_calls"] = [call.as_openai() for call in step.calls]
        chunks = [self._chunk(index, delta, logprobs, None)] if delta else []
        if not out.finished:
            return chunks
        rest, calls, has_calls = stream.finish()
        if rest:
            chunks.append(self._chunk(index, {"content": rest}, None, None))
        if calls:
            chunks.append(self._chunk(index, {"tool_calls": [call.as_openai() for call in calls]}, None, None))
        return [*chunks, self._chunk(index, {}, None, self._finish_reason(out.finish_reason, has_calls),
                                     api_stop_reason(out))]

    def usage_chunk(self, transcripts: list[Transcript]) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk", []) | {"usage": usage(transcripts)}

    def response(self, transcripts: list[Transcript]) -> dict[str, Any]:
        choices = [self._choice(i, t) for i, t in enumerate(transcripts)]
        body = self._envelope("chat.completion", choices) | {"usage": usage(transcripts)}
        if self._with_prompt_logprobs:
            body["prompt_logprobs"] = vllm_prompt_logprobs(transcripts[0].prompt_logprobs or [],
                                                           self._prompts.token_text)
        return body

    def _choice(self, index: int, transcript: Transcript) -> dict[str, Any]:
        reasoning, text = None, transcript.text
        if self._reasoning is not None:
            reasoning, text = split_reasoning(text, self._reasoning.open_at_start)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning is not None and self._include_reasoning:
            message |= _reasoning_fields(reasoning)
        calls: list[ParsedToolCall] = []
        if self._tool_parser is not None:
            message["content"], calls = self._tool_parser.parse(text)
        message["tool_calls"] = [call.as_openai() for call in calls]  # [] without calls, as vLLM's message has
        if reasoning is not None and message["content"] == "":  # all reasoning (cut short, or nothing after it):
            message["content"] = None  # no answer, as vLLM's reasoning parsers say
        if self._echo:
            message["content"] = self._echo + (message["content"] or "")
        return {"index": index, "message": message, "logprobs": self._logprobs(transcript.logprobs),
                "finish_reason": self._finish_reason(transcript.finish_reason, bool(calls)),
                "stop_reason": transcript.stop_reason}

    def _finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        return "tool_calls" if has_calls and reason == "stop" and not self._is_named_tool else reason

    def _chunk(self, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None,
               finish_reason: str | None, stop_reason: str | int | None = None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
        chunk = self._envelope("chat.completion.chunk", [choice])
        return chunk | {"usage": None} if self._include_usage else chunk

    def _logprobs(self, lps: list[TokenLogprobsMsg]) -> dict[str, Any] | None:
        if not self._with_logprobs:
            return None
        return chat_logprobs(lps, self._prompts.token_text, self._prompts.token_bytes)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        ids = self._ids
        return {"id": ids.request_id, "object": obj, "created": ids.created, "model": ids.model, "choices": choices}
