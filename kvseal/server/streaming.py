"""Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`.

An error after the stream started (engine gone, request aborted, or its audit line could not
be written) is sent as one `data: {"error": {...}}` event before `[DONE]`: the client sees an
error, never a normal finish. The audit line is written when the engine reports the end,
before this generator sees that report, so a stream whose line failed never sends its last
chunk. If the client goes away, the generator is cancelled and the request is aborted in the
engine, which frees its pages at once.

A formatter of typed events (`EventFormatter`: the Responses API's) has each payload sent as
`event: <its type>` and `data:`, an error as its own error events, and no `[DONE]`: its stream
ends with its last event, as OpenAI's and vLLM's do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvseal.messages.msgs import RequestOutputMsg
from kvseal.server import errors
from kvseal.server.call import Call
from kvseal.server.choices import ChoiceGroup
from kvseal.server.endpoint import Formatter
from kvseal.server.errors import ApiError
from kvseal.server.transcript import Transcript

_encoder = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


@runtime_checkable
class EventFormatter(Protocol):
    """A formatter whose stream is typed events, each payload with its `type`."""

    def error_events(self, err: ApiError) -> list[dict[str, Any]]: ...


def typed_sse(payload: dict[str, Any]) -> bytes:
    return b"event: " + str(payload["type"]).encode() + b"\n" + sse(payload)


class EventStreamResponse(StreamingResponse):
    """An SSE response that ends its call's HTTP side however the stream ends: completed,
    cancelled by a disconnect, or never started."""

    def __init__(self, call: Call, group: ChoiceGroup, fmt: Formatter, include_usage: bool,
                 continuous_usage: bool = False) -> None:
        super().__init__(_events(call, group, fmt, include_usage, continuous_usage), media_type="text/event-stream",
                         headers=call.response_headers() | {"cache-control": "no-cache"})
        self._call = call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._call.abort_on_exit()
            self._call.http_done()


async def _events(call: Call, group: ChoiceGroup, fmt: Formatter, include_usage: bool,
                  continuous_usage: bool) -> AsyncIterator[bytes]:
    """`continuous_usage` (vLLM's `continuous_usage_stats`): every chunk of a choice carries that
    choice's usage so far (its prompt's tokens, the tokens it has generated)."""
    transcripts = [Transcript() for _ in range(group.num_choices)]
    typed = isinstance(fmt, EventFormatter)
    encode = typed_sse if typed else sse
    for chunk in fmt.first_chunks():
        yield encode(_with_running_usage(chunk, transcripts, group) if continuous_usage else chunk)
    async for index, event in group.events():
        err = errors.for_event(event)
        if err is None and call.is_withheld:  # its audit line failed (I8): end now, never normally
            err = errors.audit_unavailable(call.state.audit)
        if err is not None and isinstance(fmt, EventFormatter):
            for error_event in fmt.error_events(err):
                yield typed_sse(error_event)
            return
        if err is not None:
            yield sse(err.body())
            yield DONE
            return
        assert isinstance(event, RequestOutputMsg)
        transcripts[index].add(event)
        for delta in fmt.delta_chunks(index, event):
            yield encode(_with_running_usage(delta, transcripts, group) if continuous_usage else delta)
    if include_usage:
        yield sse(fmt.usage_chunk(transcripts))
    if not typed:
        yield DONE


def _with_running_usage(chunk: dict[str, Any], transcripts: list[Transcript], group: ChoiceGroup) -> dict[str, Any]:
    [choice] = chunk["choices"]
    index = choice["index"]
    num_prompt, num_output = group.num_prompt_tokens[index], transcripts[index].num_output_tokens
    return chunk | {"usage": {"prompt_tokens": num_prompt, "completion_tokens": num_output,
                              "total_tokens": num_prompt + num_output}}
