"""A streamed choice's tool calls (`ToolCallStream`): what of the text can be sent, as content or
as call deltas, as it comes."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from kvseal.server.tools.calls import (
    CALL_BLOCK,
    END_TAG,
    START_TAG,
    before_partial,
    openai_id,
    parse_json_call,
)
from kvseal.server.tools.canonical_json import CanonicalJson
from kvseal.server.tools.parsers import ToolParser


@dataclass(frozen=True)
class CallDelta:
    """One entry of a streamed chunk's `tool_calls`: a call's first (its index, id, type and name,
    with the arguments known so far) or a further piece of its arguments. A client adds up the
    pieces of one index, as OpenAI's clients do."""

    index: int
    arguments: str
    name: str | None = None  # set on a call's first delta only
    id: str | None = None

    def as_openai(self) -> dict[str, Any]:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class StreamStep:
    content: str  # content to send now
    calls: list[CallDelta]  # tool_calls entries to send now


class ToolCallStream:
    """One streamed choice with tool parsing. Text before where a call may begin (the parser's
    `held_from`) streams as content, less any whitespace at its end (which the parser drops
    before a call); the text from there on is content only once the choice has ended and the
    parser has read it all, so the content streamed adds up to the content of the same answer
    unstreamed.

    Calls: with a parser that `streams_arguments` (hermes), a `<tool_call>` block's call is sent
    as it is written: its index, id and name once its name is read and its arguments have begun,
    then the arguments as they come, in the text `json.dumps` gives the parsed arguments (the
    unstreamed call's), and the rest of it when the block's `</tool_call>` comes and the parser
    reads the call (its arguments' last `}` among it). The pieces of an index add up to the
    unstreamed call. A block whose text turns out not to be a call after part of it was sent (cut
    by max_tokens, broken JSON, `</tool_call>` inside a string, a key written twice) cannot be
    taken back: its index is left as sent, arguments that are no whole JSON object, so no client
    can take it for a call to run; its text comes as content as unstreamed, a valid call of it
    is sent whole at the next index, and the finish reason is the unstreamed one ("tool_calls"
    only if the answer has calls). With any other parser the calls are sent whole when the
    choice ends."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._text = ""
        self._num_sent = 0  # of the content
        self._scan_from = 0  # where the next block may begin
        self._block: _StreamedBlock | None = None  # the block being written
        self._num_indices = 0  # handed out to calls
        self._num_calls = 0  # calls read whole

    def feed(self, new_text: str) -> StreamStep:
        """What can be sent now, with `new_text` added to the choice's text."""
        self._text += new_text
        safe = len(self._text[:self._parser.held_from(self._text)].rstrip())
        content = self._text[self._num_sent:max(safe, self._num_sent)]
        self._num_sent += len(content)
        return StreamStep(content, self._call_deltas() if self._parser.streams_arguments else [])

    def finish(self) -> tuple[str, list[CallDelta], bool]:
        """(content not yet sent, calls not yet sent, whether the answer has calls), once the
        choice has ended (after the `feed` of its last text)."""
        content, calls = self._parser.parse(self._text)
        whole = (content or "") if calls else self._text
        # What was sent is text before the first call, so `whole` begins with it
        num_sent = len(os.path.commonprefix([whole, self._text[:self._num_sent]]))
        self._num_sent = len(self._text)
        if self._parser.streams_arguments:
            return whole[num_sent:], [], bool(calls)
        return whole[num_sent:], [CallDelta(i, c.arguments, c.name, c.id) for i, c in enumerate(calls)], bool(calls)

    def _call_deltas(self) -> list[CallDelta]:
        deltas: list[CallDelta] = []
        while True:
            if self._block is None:
                if self._parser.max_calls is not None and self._num_calls >= self._parser.max_calls:
                    return deltas  # (the parser keeps no further call)
                start = self._text.find(START_TAG, self._scan_from)
                if start < 0:
                    self._scan_from = max(self._scan_from, len(self._text) - len(START_TAG) + 1)
                    return deltas
                self._block = _StreamedBlock(start)
            block = self._block
            end = self._text.find(END_TAG, max(block.body_start, block.end_scan))
            block.end_scan = len(self._text) - len(END_TAG) + 1  # no end tag wholly before this
            block.read(self._text, end if end >= 0 else max(block.body_start, before_partial(self._text, END_TAG)))
            deltas += self._arguments_delta(block)
            if end < 0:
                return deltas
            deltas += self._resolve(block)
            self._scan_from, self._block = end + len(END_TAG), None

    def _arguments_delta(self, block: _StreamedBlock) -> list[CallDelta]:
        name, fresh = block.name_and_arguments()
        if name is None or fresh is None:
            return []
        block.num_sent += len(fresh)
        if block.index is None:
            block.index, block.id = self._num_indices, openai_id()
            self._num_indices += 1
            return [CallDelta(block.index, fresh, name, block.id)]
        return [CallDelta(block.index, fresh)] if fresh else []

    def _resolve(self, block: _StreamedBlock) -> list[CallDelta]:
        """The rest of a block's call once its end tag is here: read as `parse` reads it (the
        same block: the first end tag after its start); nothing when it is no call (content)."""
        match = CALL_BLOCK.match(self._text, block.start)
        call = parse_json_call(match.group(1)) if match else None
        if call is None:
            return []
        self._num_calls += 1
        sent = block.sent_arguments()
        if block.index is not None and block.name == call.name and call.arguments.startswith(sent):
            rest = call.arguments[len(sent):]
            return [CallDelta(block.index, rest)] if rest else []
        index = self._num_indices
        self._num_indices += 1
        return [CallDelta(index, call.arguments, call.name, call.id)]



class _StreamedBlock:
    """A hermes `<tool_call>` block being written: its body (from after the tag, whitespace
    skipped as the parser skips it) read as canonical JSON as it comes (`CanonicalJson`)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.body_start = start + len(START_TAG)
        self.json = CanonicalJson()
        self.index: int | None = None  # once its first delta is sent
        self.id: str | None = None
        self.name: str | None = None
        self.num_sent = 0  # of the arguments' canonical text
        self.end_scan = 0  # where the search for its end tag goes on from
        self._num_read = 0  # of the body's text
        self._has_begun = False  # past the whitespace before the body

    def read(self, text: str, limit: int) -> None:
        """Read the body's text up to `limit` (past it may be the end tag)."""
        new = text[self.body_start + self._num_read:limit]
        self._num_read += len(new)
        if not self._has_begun:
            new = new.lstrip()
            self._has_begun = bool(new)
        if new:
            self.json.feed(new)

    def name_and_arguments(self) -> tuple[str | None, str | None]:
        """(the call's name, the canonical text of its arguments not yet sent: past `num_sent`),
        each None until it is known (or when the body is no call this stream can follow)."""
        if self.json.failed or self.json.top_kind != "{":
            return None, None
        members = self.json.members
        name = members.get("name")
        text = self.json
        if self.name is None and name is not None and name.end is not None and text.slice(name.start,
                                                                                            name.start + 1) == '"':
            self.name = json.loads(text.slice(name.start, name.end))
        arguments = members.get("arguments")
        if self.name is None or arguments is None or text.slice(arguments.start, arguments.start + 1) != "{":
            return self.name, None
        # Whole arguments wait for the parser's reading of the block: a call left unfinished
        # (`ToolCallStream`) is never one a client could take for whole
        end = arguments.end - 1 if arguments.end is not None else text.length
        start = arguments.start + self.num_sent
        return self.name, text.slice(start, end)

    def sent_arguments(self) -> str:
        arguments = self.json.members.get("arguments")
        return "" if arguments is None else self.json.slice(arguments.start, arguments.start + self.num_sent)
