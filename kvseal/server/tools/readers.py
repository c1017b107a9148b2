"""Reading a format's calls as the answer's text comes (`CallReader`), for a stream to send them
as they are written (`streaming.py`).

A reader finds the drafts of calls in the text: each one's name once the text is certainly a
call in the format (its arguments begun), then more of its arguments' canonical text (what
`json.dumps` writes of the parsed call's) as it is settled, never the arguments' last `}`: that
waits for the parser's reading of the call (`DraftRead`), so a draft that turns out no call is
never left looking whole. A reader is sound, not complete: where it cannot follow the text it
stops sending, and the parser's reading, at a block's end or the answer's, is what counts.
Every reader reads each character of the text once (or a bounded number of times), and the
parser's reading of a call's text happens once: the work is linear in the answer's length.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvseal.server.tools.calls import CALL_BLOCK, END_TAG, START_TAG, ParsedToolCall, before_partial
from kvseal.server.tools.canonical_json import CanonicalJson


@dataclass(frozen=True)
class DraftStep:
    """More of a draft's call: `name` (the same on every step of the draft) and `arguments`,
    the canonical text of its arguments past what the draft's earlier steps carried."""

    draft: int  # the reader's number of the draft, from 0 in the text's order
    name: str
    arguments: str


@dataclass(frozen=True)
class DraftRead:
    """The parser's reading of a draft's text: its call, or None when the text is no call."""

    draft: int
    call: ParsedToolCall | None


class Draft(Protocol):
    """One call's text being read, from where it may begin."""

    @property
    def is_stopped(self) -> bool:
        """Whether the text read is no call this draft can follow (it sends nothing more)."""
        ...

    @property
    def is_whole(self) -> bool:
        """Whether the call's text has ended (the rest of the answer's text is not its)."""
        ...

    def feed(self, raw: str) -> int:
        """Read the next piece of text; returns how much of it is the call's (the rest follows it)."""
        ...

    def take(self) -> tuple[str | None, str]:
        """(the call's name once it is certain, the arguments' canonical text settled since the
        last `take`: "" until the name is known)."""
        ...


class CallReader(Protocol):
    # calls are read only once the answer has ended (`ToolCallStream.finish`: the whole
    # answer is calls, or none of it is), not a block at a time
    is_whole_answer: bool
    content_end: int  # where a call may begin: the text before it, less `cuts`, may be sent as content
    # the spans [start, end) of the text before `content_end` that the parser read as calls (not
    # content), in the text's order; only a reader of calls anywhere in the text has any
    cuts: list[tuple[int, int]]

    def read(self, new_text: str) -> list[DraftStep | DraftRead]:
        """What the text, with `new_text` added, settles about the calls."""
        ...


def _steps(draft_number: int, draft: Draft) -> list[DraftStep | DraftRead]:
    name, arguments = draft.take()
    return [DraftStep(draft_number, name, arguments)] if name is not None and arguments else []


class JsonCallDraft:
    """A call written as a JSON object, `{"name": ..., KEY: {...}}`, KEY the first of
    `arguments_keys` it holds (llama3_json takes "parameters" or "arguments"). Leading
    whitespace is skipped; the object's text is read as canonical JSON (`CanonicalJson`)."""

    def __init__(self, arguments_keys: tuple[str, ...], stops_when_whole: bool) -> None:
        self.json = CanonicalJson(stops_when_whole)
        self._arguments_keys = arguments_keys
        self._name: str | None = None
        self._key: str | None = None  # the arguments' key, once they are sent
        self._num_taken = 0  # of the arguments' canonical text
        self._has_begun = False  # past the whitespace before the object

    @property
    def is_stopped(self) -> bool:
        return self.json.failed or (bool(self.json.top_kind) and self.json.top_kind != "{")

    @property
    def is_whole(self) -> bool:
        return self.json.is_whole

    def feed(self, raw: str) -> int:
        num_space = 0
        if not self._has_begun:
            num_space = len(raw) - len(raw.lstrip())
            self._has_begun = num_space < len(raw)
        return num_space + self.json.feed(raw[num_space:])

    def take(self) -> tuple[str | None, str]:
        if self.is_stopped:
            return self._name, ""
        members, text = self.json.members, self.json
        name = members.get("name")
        if self._name is None and name is not None and name.end is not None \
                and text.slice(name.start, name.start + 1) == '"':
            self._name = json.loads(text.slice(name.start, name.end))
        if self._name is None:
            return None, ""
        if self._key is None:
            self._key = next((key for key in self._arguments_keys if key in members
                              and text.slice(members[key].start, members[key].start + 1) == "{"), None)
        if self._key is None:
            return self._name, ""
        arguments = members[self._key]
        end = arguments.end - 1 if arguments.end is not None else text.length  # (never the last `}`)
        fresh = text.slice(arguments.start + self._num_taken, end)
        self._num_taken += len(fresh)
        return self._name, fresh


class BlockReader:
    """Calls in `<tool_call>` blocks anywhere in the text (hermes, qwen3_coder): a block's draft
    reads its body as it comes, and the parser reads the block (`read_call`) once its first
    `</tool_call>` has come, as `parse` reads it (`CALL_BLOCK`). The text outside the blocks is
    content as it comes, up to where a block may begin; a block is content too (its text as it
    was) once it has closed and the parser read no call in it, as `parse` leaves it."""

    is_whole_answer = False

    def __init__(self, new_draft: Callable[[], Draft], read_call: Callable[[str], ParsedToolCall | None]) -> None:
        self._new_draft = new_draft
        self._read_call = read_call
        self.content_end = 0
        self.cuts: list[tuple[int, int]] = []  # the blocks read as calls
        self._num_read = 0  # of the text
        self._pending = ""  # the end of the text read, which may begin the tag looked for
        self._block: list[str] | None = None  # the open block's text, from its start tag, as pieces
        self._block_start = 0  # where the open block's start tag is in the text
        self._draft: Draft | None = None
        self._num_drafts = 0

    def read(self, new_text: str) -> list[DraftStep | DraftRead]:
        text, start = self._pending + new_text, self._num_read - len(self._pending)
        self._num_read += len(new_text)
        steps: list[DraftStep | DraftRead] = []
        while True:
            if self._block is None:
                tag = text.find(START_TAG)
                self.content_end = start + (tag if tag >= 0 else before_partial(text, START_TAG))
                if tag < 0:
                    self._pending = text[before_partial(text, START_TAG):]
                    return steps
                self._block, self._draft, self._block_start = [START_TAG], self._new_draft(), start + tag
                self._num_drafts += 1
                text, start = text[tag + len(START_TAG):], start + tag + len(START_TAG)
            end = text.find(END_TAG)
            body = text[:end] if end >= 0 else text[:before_partial(text, END_TAG)]
            steps += self._read_body(body)
            if end < 0:
                self._pending = text[len(body):]
                return steps
            read = self._end_block()
            steps.append(read)
            text, start = text[end + len(END_TAG):], start + end + len(END_TAG)
            if read.call is not None:  # a call is no content; a block read as none is, as it was
                self.cuts.append((self._block_start, start))
            self.content_end = start

    def _read_body(self, body: str) -> list[DraftStep | DraftRead]:
        assert self._block is not None and self._draft is not None
        self._block.append(body)
        if self._draft.is_stopped:
            return []
        self._draft.feed(body)
        return _steps(self._num_drafts - 1, self._draft)

    def _end_block(self) -> DraftRead:
        assert self._block is not None
        match = CALL_BLOCK.match("".join(self._block) + END_TAG)  # (the one end tag: its last characters)
        self._block = self._draft = None
        return DraftRead(self._num_drafts - 1, self._read_call(match.group(1)) if match else None)


class Body(Protocol):
    """The text of an answer of calls from its first character (`[` or `{`) on."""

    def read(self, new_text: str) -> list[DraftStep | DraftRead]:
        ...


class WholeAnswerReader:
    """Calls that are the whole answer (llama3_json, mistral, pythonic): after whitespace and an
    optional `tag`, the `body` from its `opener` on. The text is held as it was (content only
    once the parser has read the whole answer) from the first character that may begin calls;
    text that may not is content as it comes."""

    is_whole_answer = True

    def __init__(self, tag: str, opener: str, body: Body) -> None:
        self._tag, self._opener, self._body = tag, opener, body
        self.content_end = 0
        self.cuts: list[tuple[int, int]] = []  # (none: calls are the whole answer or no part of it)
        self._num_read = 0
        self._lead = ""  # the text after the leading whitespace, while it may be the tag
        self._state = "lead"  # lead, after_tag, body, content (no calls may begin), done

    def read(self, new_text: str) -> list[DraftStep | DraftRead]:
        self._num_read += len(new_text)
        if self._state == "lead":
            new_text = self._read_lead(new_text)
        if self._state == "after_tag":
            new_text = new_text.lstrip()
            if new_text:
                self._state = "body" if new_text.startswith(self._opener) else "done"
        if self._state == "content":
            self.content_end = self._num_read
        return self._body.read(new_text) if self._state == "body" and new_text else []

    def _read_lead(self, new_text: str) -> str:
        """The text after the lead (whitespace, the tag) in `new_text`, once the lead is read."""
        lead = (self._lead + new_text).lstrip() if not self._lead else self._lead + new_text
        if not lead:
            return ""
        if lead.startswith(self._tag):
            self._state = "after_tag"
            return lead[len(self._tag):]
        if self._tag.startswith(lead):
            self._lead = lead
            return ""
        self._state = "body" if lead.startswith(self._opener) else "content"
        return lead


class JsonObjectsBody:
    """llama3_json's body: JSON call objects, separated by whitespace and `;`."""

    def __init__(self) -> None:
        self._draft: JsonCallDraft | None = None
        self._num_drafts = 0
        self._is_stopped = False

    def read(self, new_text: str) -> list[DraftStep | DraftRead]:
        steps: list[DraftStep | DraftRead] = []
        position = 0
        while position < len(new_text) and not self._is_stopped:
            if self._draft is None:
                char = new_text[position]
                if char.isspace() or char == ";":
                    position += 1
                    continue
                if char != "{":
                    self._is_stopped = True
                    break
                self._draft = JsonCallDraft(("parameters", "arguments"), stops_when_whole=True)
                self._num_drafts += 1
            position += self._draft.feed(new_text[position:])
            steps += _steps(self._num_drafts - 1, self._draft)
            self._is_stopped = self._draft.is_stopped
            if self._draft.is_whole:
                self._draft = None
        return steps


class ListBody:
    """A list of calls, `[CALL, CALL, ...]`: mistral's and pythonic's enforced JSON objects
    (`JsonCallDraft`), or pythonic's Python calls (`new_python_draft`) where the first element
    begins with a name. Whitespace between them is JSON's, or Python's."""

    def __init__(self, new_python_draft: Callable[[], Draft] | None = None) -> None:
        self._new_python_draft = new_python_draft
        self._draft: Draft | None = None
        self._num_drafts = 0
        self._expect = "open"  # open, element_or_close, element, comma_or_close, stopped
        self._is_python = False

    def read(self, new_text: str) -> list[DraftStep | DraftRead]:
        steps: list[DraftStep | DraftRead] = []
        position = 0
        while position < len(new_text) and self._expect != "stopped":
            if self._draft is None:
                position = self._separator(new_text, position)
                continue
            position += self._draft.feed(new_text[position:])
            steps += _steps(self._num_drafts - 1, self._draft)
            if self._draft.is_stopped:
                self._expect = "stopped"
            elif self._draft.is_whole:
                self._draft, self._expect = None, "comma_or_close"
        return steps

    def _separator(self, text: str, position: int) -> int:
        """Read one character between the elements, or begin an element at it (`_draft`)."""
        char, expect = text[position], self._expect
        spaces = " \t\n\r\f" if self._is_python else " \t\n\r"
        if char in spaces:
            return position + 1
        if expect == "open":
            self._expect = "element_or_close" if char == "[" else "stopped"
        elif expect == "comma_or_close" and char == ",":
            self._expect = "element_or_close" if self._is_python else "element"
        elif expect in ("element", "element_or_close") and self._begin(char):
            return position  # (the draft reads it)
        else:
            self._expect = "stopped"  # the list's end, or no list of calls: nothing more to send
        return position + 1

    def _begin(self, char: str) -> bool:
        if char == "{" and (self._num_drafts == 0 or not self._is_python):
            self._draft = JsonCallDraft(("arguments",), stops_when_whole=True)
        elif self._new_python_draft is not None and char.isidentifier() and (self._num_drafts == 0 or self._is_python):
            self._is_python = True
            self._draft = self._new_python_draft()
        else:
            return False
        self._num_drafts += 1
        return True
