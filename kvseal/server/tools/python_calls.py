"""One pythonic call, `name(key=literal, ...)`, read as it is written (`PythonCallDraft`).

Its name is sent once its `(` has come at the start of the answer's list; an argument once its
value has ended (a `,` or the call's `)` outside any string or bracket), read as the parser
reads it (`ast.literal_eval`, never run) and written as `json.dumps` writes it in the call's
arguments. Anything this reader cannot follow exactly (a comment, a line continuation, an
f-string, a positional argument) stops it; the parser's reading of the whole answer decides.
"""

from __future__ import annotations

import ast
import json
import keyword
import unicodedata
import warnings

from kvseal.server.tools.calls import NOT_JSON, is_utf8

_SPACE = " \t\f\r\n"  # between tokens inside brackets (Python joins the lines there)
_STRING_PREFIXES = frozenset({"", "r", "u", "b", "br", "rb"})  # (no f-string: its quotes nest)
_LONGEST_PREFIX = max(len(prefix) for prefix in _STRING_PREFIXES)


class PythonCallDraft:
    def __init__(self) -> None:
        self._state = "name"  # name, before_paren, key_or_close, key, equals, value, whole, stopped
        self._name: list[str] = []  # its characters (a list: a long name costs no copy per character)
        self._named = ""  # the name, NFKC-normalized, once its `(` came
        self._key: list[str] = []
        self._keys: set[str] = set()
        self._value = _ValueScan()
        self._fresh: list[str] = []  # arguments text not yet taken
        self._is_named = False

    @property
    def is_stopped(self) -> bool:
        return self._state == "stopped"

    @property
    def is_whole(self) -> bool:
        return self._state == "whole"

    def feed(self, raw: str) -> int:
        for position, char in enumerate(raw):
            if self._state in ("whole", "stopped"):
                return position
            if self._state == "value":
                self._value_char(char)
            else:
                self._state = self._next_state(char)
        return len(raw)

    def take(self) -> tuple[str | None, str]:
        fresh, self._fresh = "".join(self._fresh), []
        return (self._named if self._is_named else None), fresh

    def _next_state(self, char: str) -> str:
        state = self._state
        if state == "name" and _continues_identifier(self._name, char):
            self._name.append(char)
            return "name"
        if state in ("name", "before_paren") and char in _SPACE:
            return "before_paren"
        if state in ("name", "before_paren") and char == "(" and self._name \
                and not keyword.iskeyword(name := "".join(self._name)):
            self._is_named = True
            self._named = unicodedata.normalize("NFKC", name)
            self._fresh.append("{")
            return "key_or_close"
        if state in ("key_or_close", "equals") and char in _SPACE:
            return state
        if state == "key_or_close" and char == ")":
            return "whole"
        if state in ("key_or_close", "key") and _continues_identifier(self._key, char):
            self._key.append(char)
            return "key"
        if state == "key" and char in _SPACE:
            return "equals"
        if state in ("key", "equals") and char == "=" and not keyword.iskeyword("".join(self._key)):
            self._value = _ValueScan()
            return "value"
        return "stopped"

    def _value_char(self, char: str) -> None:
        """A character of an argument's value, or the `,` or `)` after it."""
        end = self._value.feed(char)
        if end is None:
            return
        if end == "stopped" or not self._argument():
            self._state = "stopped"
        else:
            self._state = "whole" if end == ")" else "key_or_close"

    def _argument(self) -> bool:
        """Send the argument just ended; False where the parser would not read it as this one."""
        key = unicodedata.normalize("NFKC", "".join(self._key))
        value = _literal(self._value.text())
        if value is _NOT_A_LITERAL or key in self._keys:  # (a key given twice is a syntax error)
            return False
        try:
            dumped = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, *NOT_JSON):
            return False
        piece = f"{', ' if self._keys else ''}{json.dumps(key, ensure_ascii=False)}: {dumped}"
        if not is_utf8(piece):
            return False
        self._keys.add(key)
        self._key = []
        self._fresh.append(piece)
        return True


def _continues_identifier(chars: list[str], char: str) -> bool:
    """Whether `chars` + `char` is an identifier, given that `chars` is one (or empty): what
    `str.isidentifier` answers, one character at a time (a first character may start one, any
    other must continue one), so a long name is not read again for each character."""
    return char.isidentifier() if not chars else ("_" + char).isidentifier()


_NOT_A_LITERAL = object()


def _literal(text: str) -> object:
    """The literal `text` is, read as it reads inside the call's brackets (where lines join), or
    `_NOT_A_LITERAL`."""
    if not text.strip():
        return _NOT_A_LITERAL
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            return ast.literal_eval(f"({text})")
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_A_LITERAL


class _ValueScan:
    """Where a keyword argument's value ends: the first `,` or `)` outside its strings and
    brackets. Each character is looked at once."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._depth = 0
        self._word = ""  # the letters just before a quote: its string's prefix
        self._quote_char = ""  # of the quotes opening a string
        self._quote = ""  # the open string's quote (', ", ''' or """); "" outside strings
        self._num_quotes = 0  # quotes in a row: opening one (1, 2), or closing a triple-quoted one
        self._is_escaped = False

    def text(self) -> str:
        return "".join(self._pieces)

    def feed(self, char: str) -> str | None:
        """None while the value goes on; else `,` or `)` (the value ended before `char`), or
        "stopped" where this scan cannot follow the text."""
        if self._num_quotes and not self._quote and self._opening_quote(char):
            self._pieces.append(char)
            return None
        if self._quote:
            self._string_char(char)
            self._pieces.append(char)
            return None
        return self._code_char(char)

    def _code_char(self, char: str) -> str | None:
        if char in "'\"":
            if self._word.lower() not in _STRING_PREFIXES:
                return "stopped"
            self._num_quotes, self._word = 1, ""
            self._quote_char = char
        elif char in "#\\":
            return "stopped"  # a comment or a line continuation: not followed here
        elif self._depth == 0 and char in ",)":
            return char
        elif char in "([{":
            self._depth += 1
        elif char in ")]}":
            self._depth -= 1
        # (a word longer than any string prefix is kept at that length: it is no prefix either way)
        self._word = (self._word + char)[:_LONGEST_PREFIX + 1] if char.isalnum() or char == "_" else ""
        self._pieces.append(char)
        return None

    def _opening_quote(self, char: str) -> bool:
        """After one or two quotes outside a string: a third makes a triple-quoted string; two
        and anything else an empty string; one and anything else a string of one quote.
        Whether `char` was one of the opening quotes."""
        quote = self._quote_char
        if char == quote and self._num_quotes == 1:
            self._num_quotes = 2
            return True
        if char == quote:
            self._quote, self._num_quotes = quote * 3, 0
            return True
        if self._num_quotes == 2:
            self._num_quotes = 0  # '' then `char`, outside any string
        else:
            self._quote, self._num_quotes = quote, 0
        return False

    def _string_char(self, char: str) -> None:
        if self._is_escaped:
            self._is_escaped = False
        elif char == "\\":
            self._is_escaped = True
        elif char == self._quote[0]:
            self._num_quotes += 1
            if self._num_quotes == len(self._quote):
                self._quote, self._num_quotes = "", 0
            return
        self._num_quotes = 0
