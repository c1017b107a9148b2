"""`POST /v1/responses` (OpenAI's Responses API), stateless, as vLLM serves it by default.

A Responses request is a chat completion in another shape (`responses_body.py`): it takes
chat's path through the pipeline (key, tenant, limits, bounds, admission, audit, engine) and
chat's formatter builds its answer, split as chat splits it (reasoning with a reasoning
parser, tool calls with the tool call parser). This module turns that answer into the
Responses shape: a `response` object whose `output` is a `reasoning` item (when the model
reasoned), a `message` item of `output_text`, and a `function_call` item per call; `status`
is `incomplete` (`incomplete_details.reason` "max_output_tokens") when the output was cut by
its length, else `completed`. Streamed, it is OpenAI's typed events, each `event: <type>` and
`data:` with its `sequence_number`: response.created, response.in_progress, then per item
output_item.added, content_part.added, the deltas (output_text, reasoning_text,
function_call_arguments), their .done events, content_part.done, output_item.done, and last
response.completed, whose response has the status (`incomplete` too: vLLM ends every stream
with response.completed, where OpenAI sends response.incomplete, and the `openai` client's
`responses.stream()` takes only response.completed as the end). The stream ends with that
event (no `[DONE]`, as vLLM's and OpenAI's); an error after it began is one `error` event, and
nothing after it.

No response is stored (vLLM keeps none unless its operator sets
VLLM_ENABLE_RESPONSES_API_STORE; a store shared by tenants would need each response kept
under its tenant, which kvseal does not build): `store` is taken and `false` in the answer,
`previous_response_id` and `GET /v1/responses/{id}` are 404 `response_not_found`, saying so.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvseal.admission import AdmissionLimits
from kvseal.errors import InvalidParameter
from kvseal.generation_defaults import GenerationDefaults
from kvseal.messages.msgs import RequestOutputMsg
from kvseal.server.auth import Tenant
from kvseal.server.bounds import check_tool_definitions
from kvseal.server.chat import ChatEndpoint, ChatFormatter
from kvseal.server.endpoint import AdmittedPrompt, Prepared, ResponseIds
from kvseal.server.errors import ApiError
from kvseal.server.prompts import PromptEncoder
from kvseal.server.responses_body import NamedFunctionChoice, ResponsesBody, ResponsesRequest
from kvseal.server.sampling import build_sampling_params
from kvseal.server.tools import tool_setup
from kvseal.server.transcript import Transcript
from kvseal.types import SamplingParams


def response_not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found: this server stores no responses (store is "
                         f"not kept). Send the whole conversation in input instead of previous_response_id.",
                    code="response_not_found", param="previous_response_id")


class ResponsesEndpoint:
    path = "/v1/responses"
    id_prefix = "resp_"
    body_model = ResponsesBody

    def __init__(self, chat: ChatEndpoint) -> None:
        self._chat = chat  # the server's chat endpoint: its tool call parser and reasoning markers

    async def prepare(self, body: ResponsesBody, prompts: PromptEncoder, tenant: Tenant,
                      limits: AdmissionLimits, defaults: GenerationDefaults) -> Prepared:
        """As chat prepares its request, its errors naming the Responses fields."""
        if body.responses.previous_response_id is not None:
            raise response_not_found(body.responses.previous_response_id)
        tools = tool_setup(body, self._chat.tool_call_parser)
        if tools.definitions is not None:
            await check_tool_definitions(tools.definitions, tools.grammar_tools, limits, prompts.max_token_chars)
        conversation = [m.as_template_input() for m in body.messages]
        try:
            ids = await prompts.chat_ids(conversation, tenant.name, limits, body.truncate_prompt_tokens is not None,
                                         tools.definitions, body.chat_options)
        except InvalidParameter as exc:  # the template refused the conversation: here it is `input`
            if exc.param == "messages":
                exc.param = "input"
            raise
        params = build_sampling_params(body, max_tokens=body.max_completion_tokens, num_prompt_tokens=len(ids),
                                       limits=limits, logprobs=None, tenant=tenant, defaults=defaults,
                                       max_tokens_param="max_output_tokens")
        if tools.grammar is not None:
            params = dataclasses.replace(params, structured=tools.grammar)
        return Prepared([ids], [params], conversation)

    async def formatter(self, body: ResponsesBody, ids: ResponseIds, prompts: PromptEncoder,
                        admitted: list[AdmittedPrompt]) -> ResponsesFormatter:
        chat = await self._chat.formatter(body, ids, prompts, admitted)
        return ResponsesFormatter(chat, body.responses, ids)


@dataclass
class _Item:
    """An output item as it is built: its position, its kind and what it holds so far."""

    index: int
    kind: str  # "message", "reasoning" or "function_call"
    id: str
    text: str = ""  # a message's or a reasoning's text, a call's arguments
    name: str = ""  # a call's
    call_id: str = ""
    status: str = "in_progress"  # until it ends: completed, or incomplete when the output was cut in it

    @property
    def done(self) -> bool:
        return self.status != "in_progress"

    def as_output(self, status: str | None = None) -> dict[str, Any]:
        status = status or self.status
        if self.kind == "message":
            content = [_output_text(self.text)] if status != "in_progress" else []
            return {"id": self.id, "type": "message", "role": "assistant", "status": status, "content": content}
        if self.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": self.text}] if status != "in_progress" else []
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content, "status": status}
        return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                "arguments": self.text if status != "in_progress" else "", "status": status}


@dataclass
class _Stream:
    items: list[_Item] = field(default_factory=list)
    calls: dict[int, _Item] = field(default_factory=dict)  # by the chat stream's tool call index
    token_ids: list[int] = field(default_factory=list)


def _status(finish_reason: str | None) -> str:
    """A response cut by its length is incomplete (and so is its last item)."""
    return "incomplete" if finish_reason == "length" else "completed"


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item_id(kind: str) -> str:
    return {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind] + f"_{uuid.uuid4().hex}"


class ResponsesFormatter:
    """Chat's formatter's answer, and its stream chunks, in the Responses shape."""

    def __init__(self, chat: ChatFormatter, request: ResponsesRequest, ids: ResponseIds) -> None:
        self._chat = chat
        self._request = request
        self._ids = ids
        self._reasoning = chat.reasoning_gate
        self._params: SamplingParams | None = None
        self._sequence_number = 0
        self._stream = _Stream()

    def engine_params(self, params: SamplingParams) -> SamplingParams:
        params = self._chat.engine_params(params)
        self._params = params  # echoed: the temperature and top_p the request ran with
        return params

    # --- the response object

    def response(self, transcripts: list[Transcript]) -> dict[str, Any]:
        [transcript] = transcripts
        [choice] = self._chat.response(transcripts)["choices"]
        message = choice["message"]
        items: list[_Item] = []
        if message.get("reasoning"):
            items.append(_Item(len(items), "reasoning", _item_id("reasoning"), message["reasoning"]))
        if message["content"] or not message["tool_calls"] and not items:  # an empty answer is an empty message
            items.append(_Item(len(items), "message", _item_id("message"), message["content"] or ""))
        for call in message["tool_calls"]:
            items.append(_Item(len(items), "function_call", _item_id("function_call"), call["function"]["arguments"],
                               call["function"]["name"], call["id"]))
        for item in items:
            item.status = "completed"
        items[-1].status = _status(transcript.finish_reason)
        return self._object(items, transcript.finish_reason, transcript.num_prompt_tokens,
                            transcript.num_cached_tokens, transcript.num_output_tokens, transcript.token_ids)

    def _object(self, items: list[_Item], finish_reason: str | None, num_prompt: int, num_cached: int,
                num_output: int, token_ids: list[int]) -> dict[str, Any]:
        status = _status(finish_reason)
        usage = {"input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": num_cached},
                 "output_tokens": num_output,
                 "output_tokens_details": {"reasoning_tokens": self._num_reasoning_tokens(token_ids)},
                 "total_tokens": num_prompt + num_output}
        return self._envelope(status) | {
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": [item.as_output() for item in items], "usage": usage}

    def _envelope(self, status: str) -> dict[str, Any]:
        """The response object's fields besides its output: the request's, echoed."""
        request, params = self._request, self._params
        tool_choice: Any = request.tool_choice or "auto"
        if isinstance(tool_choice, NamedFunctionChoice):
            tool_choice = tool_choice.model_dump()
        text_format = request.text.format if request.text is not None else None
        return {
            "id": self._ids.request_id, "object": "response", "created_at": self._ids.created, "status": status,
            "background": False, "error": None, "incomplete_details": None, "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens, "max_tool_calls": None, "model": self._ids.model,
            "output": [], "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": request.reasoning.model_dump() if request.reasoning is not None else None,
            "store": False,
            "temperature": params.temperature if params is not None else request.temperature,
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True)
                     if text_format is not None else {"type": "text"}},
            "tool_choice": tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in request.tools or []],
            "top_p": params.top_p if params is not None else request.top_p,
            "truncation": request.truncation or "disabled", "usage": None, "user": request.user,
            "metadata": request.metadata or {},
        }

    def _num_reasoning_tokens(self, token_ids: list[int]) -> int:
        """The output tokens inside the reasoning block, its markers left out (as vLLM's
        reasoning parsers count them); 0 without a reasoning parser."""
        gate = self._reasoning
        if gate is None:
            return 0
        start = 0
        if not gate.open_at_start:
            if not token_ids or token_ids[0] != gate.start_token_id:
                return 0
            start = 1
        end = token_ids.index(gate.end_token_id, start) if gate.end_token_id in token_ids[start:] else len(token_ids)
        return end - start

    # --- the stream

    def first_chunks(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self._envelope("in_progress")),
                self._event("response.in_progress", response=self._envelope("in_progress"))]

    def delta_chunks(self, index: int, out: RequestOutputMsg) -> list[dict[str, Any]]:
        self._stream.token_ids.extend(out.new_token_ids)
        events: list[dict[str, Any]] = []
        for chunk in self._chat.delta_chunks(index, out):
            for choice in chunk["choices"]:
                events += self._delta_events(choice["delta"])
        if out.finished:
            events += self._end_events(out)
        return events

    def usage_chunk(self, transcripts: list[Transcript]) -> dict[str, Any]:
        """Not sent: the usage is in the last event, response.completed (its `stream_options`
        are not a Responses field)."""
        raise AssertionError("a Responses stream has no usage chunk")

    def error_events(self, err: ApiError) -> list[dict[str, Any]]:
        """The stream's end when it fails after it began (the engine gone, the request aborted,
        its audit line not written): one `error` event."""
        return [self._event("error", code=err.code or err.type, message=err.message, param=err.param)]

    def _delta_events(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.get("reasoning"):
            item, events = self._current("reasoning")
            item.text += delta["reasoning"]
            events.append(self._event("response.reasoning_text.delta", item_id=item.id, output_index=item.index,
                                      content_index=0, delta=delta["reasoning"]))
        calls = delta.get("tool_calls") or []
        for call in calls:  # the rest of a call read in this step may come with the text after its block
            if "id" not in call:
                events += self._call_events(call)
        if delta.get("content"):
            item, opened = self._current("message")
            item.text += delta["content"]
            events += [*opened, self._event("response.output_text.delta", item_id=item.id, output_index=item.index,
                                            content_index=0, delta=delta["content"], logprobs=[])]
        for call in calls:
            if "id" in call:
                events += self._call_events(call)
        return events

    def _current(self, kind: str) -> tuple[_Item, list[dict[str, Any]]]:
        """The open item of `kind` (a message or a reasoning), and the events that opened it
        (none if it was open): any other open item ends first."""
        items = self._stream.items
        if items and items[-1].kind == kind and not items[-1].done:
            return items[-1], []
        events = self._close_all()
        item = _Item(len(items), kind, _item_id(kind))
        items.append(item)
        part = _output_text("") if kind == "message" else {"type": "reasoning_text", "text": ""}
        return item, [*events, self._event("response.output_item.added", output_index=item.index,
                                           item=item.as_output("in_progress")),
                      self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                                  content_index=0, part=part)]

    def _call_events(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A call's first delta opens its item (ending an open message or reasoning; calls may
        stay open together, as a format whose answer is all calls ends each when it ends), its
        other deltas add to its arguments."""
        stream, events = self._stream, []
        arguments = call["function"].get("arguments") or ""
        if "id" in call:
            open_text = [i for i in stream.items if not i.done and i.kind != "function_call"]
            events += self._close(open_text)
            item = _Item(len(stream.items), "function_call", _item_id("function_call"), "",
                         call["function"]["name"], call["id"])
            stream.items.append(item)
            stream.calls[call["index"]] = item
            events.append(self._event("response.output_item.added", output_index=item.index,
                                      item=item.as_output("in_progress")))
        item = stream.calls[call["index"]]
        if arguments and not item.done:  # (a call's item ends with the answer or when text follows it)
            item.text += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                      output_index=item.index, delta=arguments))
        return events

    def _close_all(self) -> list[dict[str, Any]]:
        return self._close([i for i in self._stream.items if not i.done])

    def _close(self, items: list[_Item], status: str = "completed") -> list[dict[str, Any]]:
        """End `items` with `status`; a function call whose arguments are no whole JSON object
        is `incomplete` whatever the status: a draft the parser did not read as a call (cut by
        max_output_tokens, broken, text after all) sends no closing `}` (`ToolCallStream`), and
        no client may run it as a completed call."""
        events = []
        for item in items:
            item.status = status if item.kind != "function_call" or _is_json_object(item.text) else "incomplete"
            if item.kind == "function_call":
                events.append(self._event("response.function_call_arguments.done", item_id=item.id,
                                          output_index=item.index, arguments=item.text))
            else:
                part = _output_text(item.text) if item.kind == "message" else \
                    {"type": "reasoning_text", "text": item.text}
                if item.kind == "message":
                    events.append(self._event("response.output_text.done", item_id=item.id, output_index=item.index,
                                              content_index=0, text=item.text, logprobs=[]))
                else:
                    events.append(self._event("response.reasoning_text.done", item_id=item.id,
                                              output_index=item.index, content_index=0, text=item.text))
                events.append(self._event("response.content_part.done", item_id=item.id, output_index=item.index,
                                          content_index=0, part=part))
            events.append(self._event("response.output_item.done", output_index=item.index,
                                      item=item.as_output()))
        return events

    def _end_events(self, out: RequestOutputMsg) -> list[dict[str, Any]]:
        stream = self._stream
        events: list[dict[str, Any]] = []
        if not stream.items:  # an empty answer is an empty message, as unstreamed
            item, events = self._current("message")
        events += self._close([i for i in stream.items if not i.done], _status(out.finish_reason))
        body = self._object(stream.items, out.finish_reason, out.num_prompt_tokens, out.num_cached_tokens,
                            out.num_output_tokens, stream.token_ids)
        return [*events, self._event("response.completed", response=body)]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return event


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
