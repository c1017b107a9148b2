"""A JSON value's canonical text (what `json.dumps` writes of it) as its raw text comes, for a
streamed call's arguments (`streaming.py`)."""

from __future__ import annotations

import bisect
import json
import re
import string
from dataclasses import dataclass


@dataclass
class Member:
    """Where a member's value of a JSON object stands in its canonical text: from `start`, to
    `end` once the value is whole (None until then)."""

    start: int
    end: int | None = None


_JSON_SPACE = frozenset(" \t\n\r")
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_JSON_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset(string.hexdigits)


class CanonicalJson:
    """One JSON value's canonical text, `json.dumps(json.loads(raw), ensure_ascii=False)`, as its
    raw text comes: `feed` adds what the raw text so far settles (a string's characters as they
    come, a number or literal once it ends), so `text` is always a beginning of the whole
    value's. It reads JSON as json.loads does, and stops (`failed`, `text` kept as it was) at
    anything json.loads would refuse, at NaN or Infinity (which no call's arguments may hold),
    and at a key written twice in one object (json.loads keeps the last value in the first one's
    place: not a continuation of the text so far). `members`: where each member of the value,
    when it is an object, stands in the text (`length`, `slice`).

    The text is kept as the pieces it was emitted in, with their offsets: a piece of it costs
    its own length to read (`slice`), never the whole text's, so a long call streams in time
    linear in its length (the frontend's event loop is every tenant's)."""

    def __init__(self, stops_when_whole: bool = False) -> None:
        """`stops_when_whole`: `feed` reads no further than the value's end (text may follow it, as
        in a list of calls); else anything but whitespace after it stops the reading."""
        self._stops_when_whole = stops_when_whole
        self._pieces: list[str] = []
        self._offsets: list[int] = []  # where each piece starts in the text
        self.length = 0  # of the text so far
        self.failed = False
        self.top_kind = ""  # the value's first character, once read
        self.members: dict[str, Member] = {}
        self._stack: list[set[str] | None] = []  # per open container: an object's keys, None for an array
        self._expect = "value"  # value, value_or_close, key, key_or_close, colon, comma_or_close, done
        self._token: list[str] = []  # a number or literal being read (its characters: no copy per one)
        self._string: list[str] | None = None  # the string being read, decoded
        self._is_key = False
        self._escape = ""  # an escape being read, from its backslash
        self._high_surrogate: int | None = None  # a \uD800-\uDBFF escape, paired if a low one follows
        self._last_key = ""  # of the top object's member being read

    @property
    def is_whole(self) -> bool:
        return self._expect == "done" and not self.failed

    def feed(self, raw: str) -> int:
        """Read `raw`, the raw text's next piece; returns how much of it was read: all of it, less
        where the reading stopped (`failed`, or the value whole with `stops_when_whole`)."""
        for num_read, char in enumerate(raw):
            if self.failed or (self._stops_when_whole and self._expect == "done"):
                return num_read
            if self._string is not None:
                self._string_char(char)
            elif self._token and (char.isalnum() or char in "+-."):
                self._token.append(char)
            else:
                if self._token:
                    self._end_token()
                if not self.failed and char not in _JSON_SPACE:
                    self._structural(char)
        return len(raw)

    def _structural(self, char: str) -> None:
        expect = self._expect
        if expect in ("value", "value_or_close") and char not in "]}":
            self._begin_value(char)
        elif expect in ("key", "key_or_close") and char == '"':
            self._begin_string(is_key=True)
        elif expect == "colon" and char == ":":
            self._emit(": ")
            self._expect = "value"
        elif expect == "comma_or_close" and char == ",":
            self._emit(", ")
            self._expect = "key" if self._stack[-1] is not None else "value"
        elif expect in ("key_or_close", "comma_or_close") and char == "}" and self._stack[-1] is not None:
            self._close("}")
        elif expect in ("value_or_close", "comma_or_close") and char == "]" and self._stack[-1] is None:
            self._close("]")
        else:
            self.failed = True

    def _begin_value(self, char: str) -> None:
        if not self._stack:
            self.top_kind = char
        elif len(self._stack) == 1 and self._stack[0] is not None:
            self.members[self._last_key].start = self.length
        if char in "{[":
            self._emit(char)
            self._stack.append(set() if char == "{" else None)
            self._expect = "key_or_close" if char == "{" else "value_or_close"
        elif char == '"':
            self._begin_string(is_key=False)
        elif char == "-" or char.isalnum():
            self._token = [char]
        else:
            self.failed = True

    def _close(self, char: str) -> None:
        self._emit(char)
        self._stack.pop()
        self._value_done()

    def _value_done(self) -> None:
        if not self._stack:
            self._expect = "done"
            return
        if len(self._stack) == 1 and self._stack[0] is not None:
            self.members[self._last_key].end = self.length
        self._expect = "comma_or_close"

    def _end_token(self) -> None:
        token, self._token = "".join(self._token), []
        if token in ("true", "false", "null"):
            self._emit(token)
        elif _JSON_NUMBER.fullmatch(token):
            try:  # (an integer past Python's digit limit, a float past its range: refused as json.loads / dumps do)
                self._emit(json.dumps(json.loads(token), allow_nan=False))
            except ValueError:
                self.failed = True
                return
        else:
            self.failed = True
            return
        self._value_done()

    def _begin_string(self, is_key: bool) -> None:
        self._string, self._is_key = [], is_key
        self._emit('"')

    def _string_char(self, char: str) -> None:
        if self._escape:
            self._escape_char(char)
        elif char == "\\":
            self._escape = char
        elif char == '"':
            self._end_string()
        elif char < " ":
            self.failed = True  # (json.loads is strict: no raw control character in a string)
        else:
            self._decoded(char)

    def _escape_char(self, char: str) -> None:
        self._escape += char
        if len(self._escape) == 2 and char != "u":
            decoded = _JSON_ESCAPES.get(char)
            self._escape = ""
            if decoded is None:
                self.failed = True
            else:
                self._decoded(decoded)
        elif len(self._escape) > 2 and char not in _HEX:
            self.failed = True
        elif len(self._escape) == 6:
            unit, self._escape = int(self._escape[2:], 16), ""
            self._code_unit(unit)

    def _code_unit(self, unit: int) -> None:
        """A \\u escape's unit: a high surrogate waits for a low one to make one character with;
        a lone one stops the reading, as the parser refuses it (`arguments_json`)."""
        if self._high_surrogate is not None and 0xDC00 <= unit <= 0xDFFF:
            high, self._high_surrogate = self._high_surrogate, None
            self._decoded(chr(0x10000 + ((high - 0xD800) << 10) + (unit - 0xDC00)))
        elif 0xD800 <= unit <= 0xDBFF:
            self._flush_surrogate()
            self._high_surrogate = unit
        elif 0xDC00 <= unit <= 0xDFFF:
            self.failed = True
        else:
            self._decoded(chr(unit))

    def _flush_surrogate(self) -> None:
        if self._high_surrogate is not None:  # a high surrogate no low one followed
            self.failed = True

    def _decoded(self, char: str) -> None:
        assert self._string is not None
        self._flush_surrogate()
        if self.failed:
            return
        self._string.append(char)
        self._emit(json.dumps(char, ensure_ascii=False)[1:-1] if char < " " or char in '"\\' else char)

    def _end_string(self) -> None:
        assert self._string is not None
        self._flush_surrogate()
        if self.failed:
            return
        value, self._string = "".join(self._string), None
        self._emit('"')
        if not self._is_key:
            self._value_done()
            return
        keys = self._stack[-1]
        assert keys is not None
        if value in keys:
            self.failed = True
            return
        keys.add(value)
        if len(self._stack) == 1:
            self._last_key = value
            self.members[value] = Member(self.length)
        self._expect = "colon"

    @property
    def text(self) -> str:
        """The canonical text so far, whole (a copy of all of it: `slice` reads a piece)."""
        return self.slice(0, self.length)

    def slice(self, start: int, end: int) -> str:
        """The text's characters from `start` to `end`, read from the pieces that hold them."""
        if start >= end:
            return ""
        first = bisect.bisect_right(self._offsets, start) - 1
        last = bisect.bisect_left(self._offsets, end)
        joined = "".join(self._pieces[first:last])
        base = self._offsets[first]
        return joined[start - base:end - base]

    def _emit(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self._offsets.append(self.length)
            self.length += len(text)
