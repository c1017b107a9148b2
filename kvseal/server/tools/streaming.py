"""A streamed choice's tool calls (`ToolCallStream`): what of the text can be sent, as content or
as call deltas, as it comes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvseal.server.tools.readers import DraftRead, DraftStep

if TYPE_CHECKING:
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
    """One streamed choice with tool parsing. Text before where a call may begin (its reader's
    `content_end`) streams as content, less the calls read before it (the reader's `cuts`: the
    `<tool_call>` blocks of hermes and qwen3_coder, whose text around and between them streams
    as it is written) and less any whitespace at its end (content only once more content follows:
    the parser drops it at the answer's end); the text from there on is content only once the
    choice has ended and the parser has read it all, so the content streamed adds up to the
    content of the same answer unstreamed.

    Calls are sent as they are written (`readers.py`): a call's index, id and name once the text
    is certainly a call in the format and its arguments have begun, then the arguments as they
    are settled, in the text `json.dumps` gives the parsed arguments (the unstreamed call's),
    and the rest of them (their last `}` among it) once the parser has read the call: at its
    block's `</tool_call>` (hermes, qwen3_coder), or when the choice ends (llama3_json, mistral,
    pythonic: their answer is calls only if all of it is). The pieces of an index add up to the
    unstreamed call. A draft whose text turns out not to be that call after part of it was sent
    (cut by max_tokens, broken JSON, text after the calls, a key written twice) cannot be taken
    back: its index is left as sent, arguments that are no whole JSON object, so no client can
    take it for a call to run; the text comes as content as unstreamed, a call the parser reads
    from it is sent whole at the next index, and the finish reason is the unstreamed one
    ("tool_calls" only if the answer has calls).

    The work is linear in the text's length: the text is kept as pieces, each character is read
    once by the reader, and the parser reads a block, or the whole answer, once."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._reader = parser.call_reader()
        self._pieces: list[str] = []  # the text, as it came
        self._unseen: list[str] = []  # the text from `_num_seen` on
        self._num_seen = 0  # of the text: up to the reader's content_end when last looked at
        self._unsent: list[str] = []  # whitespace before `_num_seen`, held in case a call follows
        self._sent: list[str] = []  # the content sent
        self._num_cuts = 0  # of the reader's cuts: those before `_num_seen`, left out of the content
        self._drafts: dict[int, _SentCall] = {}  # drafts sent a part of, by the reader's number
        self._refused: set[int] = set()  # drafts that are to send nothing (past the calls kept)
        self._num_indices = 0  # handed out to calls
        self._num_calls = 0  # calls read whole

    def feed(self, new_text: str) -> StreamStep:
        """What can be sent now, with `new_text` added to the choice's text."""
        self._pieces.append(new_text)
        events = self._reader.read(new_text)
        return StreamStep(self._content(new_text), self._deltas(events))

    def finish(self) -> tuple[str, list[CallDelta], bool]:
        """(content not yet sent, calls not yet sent, whether the answer has calls), once the
        choice has ended (after the `feed` of its last text)."""
        text = "".join(self._pieces)
        content, calls = self._parser.parse(text)
        whole = (content or "") if calls else text
        # What was sent is the text outside the calls read, up to where a call may begin, so
        # `whole` begins with it
        num_sent = len(os.path.commonprefix([whole, "".join(self._sent)]))
        deltas = self._deltas([DraftRead(i, call) for i, call in enumerate(calls)]) \
            if self._reader.is_whole_answer else []
        return whole[num_sent:], deltas, bool(calls)

    def _content(self, new_text: str) -> str:
        """The content `new_text` lets out: the text up to the reader's `content_end`, less the
        calls read in it and the whitespace at its end (which goes out once text follows it)."""
        self._unseen.append(new_text)
        end = self._reader.content_end
        if end <= self._num_seen:
            return ""
        unseen = "".join(self._unseen)  # (text held for a call is joined here once, when let out)
        seen = self._outside_calls(unseen[:end - self._num_seen])
        self._unseen = [unseen[end - self._num_seen:]]
        self._num_seen = end
        if not seen.strip():
            self._unsent.append(seen)
            return ""
        content = "".join(self._unsent) + seen.rstrip()
        self._unsent = [seen[len(seen.rstrip()):]]
        self._sent.append(content)
        return content

    def _outside_calls(self, seen: str) -> str:
        """`seen`, the text from `_num_seen` on, less the calls the reader cut from it (each cut
        lies within it: a block's cut comes with `content_end` moving past the block)."""
        cuts = self._reader.cuts[self._num_cuts:]
        self._num_cuts += len(cuts)
        kept, position = [], self._num_seen
        for cut_start, cut_end in cuts:
            kept.append(seen[position - self._num_seen:cut_start - self._num_seen])
            position = cut_end
        kept.append(seen[position - self._num_seen:])
        return "".join(kept)

    def _deltas(self, events: list[DraftStep | DraftRead]) -> list[CallDelta]:
        deltas: list[CallDelta] = []
        for event in events:
            deltas += self._step(event) if isinstance(event, DraftStep) else self._read(event)
        return deltas

    def _may_open(self) -> bool:
        max_calls = self._parser.max_calls
        return max_calls is None or self._num_calls + len(self._drafts) < max_calls

    def _step(self, step: DraftStep) -> list[CallDelta]:
        sent = self._drafts.get(step.draft)
        if sent is not None:
            sent.pieces.append(step.arguments)
            return [CallDelta(sent.index, step.arguments)]
        if step.draft in self._refused or not self._may_open():
            self._refused.add(step.draft)
            return []
        sent = self._drafts[step.draft] = _SentCall(self._num_indices, self._parser.new_call_id(), step.name,
                                                    [step.arguments])
        self._num_indices += 1
        return [CallDelta(sent.index, step.arguments, sent.name, sent.id)]

    def _read(self, read: DraftRead) -> list[CallDelta]:
        """The rest of a call the parser has read: the rest of its draft's arguments where what
        was sent begins them, else the whole call at the next index; nothing when it is no call
        (content) or past the calls the parser keeps."""
        sent = self._drafts.pop(read.draft, None)
        call, max_calls = read.call, self._parser.max_calls
        if call is None or (max_calls is not None and self._num_calls >= max_calls):
            return []
        self._num_calls += 1
        sent_arguments = "".join(sent.pieces) if sent is not None else ""
        if sent is not None and sent.name == call.name and call.arguments.startswith(sent_arguments):
            rest = call.arguments[len(sent_arguments):]
            return [CallDelta(sent.index, rest)] if rest else []
        index = self._num_indices
        self._num_indices += 1
        return [CallDelta(index, call.arguments, call.name, call.id)]


@dataclass
class _SentCall:
    """A draft's call as sent so far."""

    index: int
    id: str
    name: str
    pieces: list[str]  # of its arguments
