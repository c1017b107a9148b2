"""A string's `pattern` in a tool's schema, checked against the model's text for it (qwen3_coder
types a value so): `PatternChecks`, one per request.

The tenant writes the pattern, the model writes the text, and the check runs on the frontend's
event loop, which every tenant's requests share: a pattern that backtracks (`^(a|aa)+$` against
`aaa...a!` takes about 6 times longer with every 4 more characters) would stop them all. So one
request's checks share `PATTERN_BUDGET_S` of time, and each runs with the `regex` package, whose
search takes a timeout (its default syntax is `re`'s). Not held against the text, as a pattern
`re` cannot read never was: a pattern that Python's `re` cannot parse or `regex` cannot compile;
one longer than `MAX_PATTERN_CHARS` or whose counted repeats unroll past `MAX_PATTERN_SIZE`
nodes (neither parsing nor compiling takes a timeout: `regex` compiles `a{n}` by unrolling it,
`(?:a{1000}){1000}` for a second); one whose search outlasts what
is left of the budget; and every pattern once the budget is spent. Every answer is kept for the
request's life, so its stream (a parameter typed as its value ends) and its whole answer's parse
type a value alike, whatever the clock did between them.
"""

from __future__ import annotations

import re
import time
import warnings
from re import _parser as re_parser  # type: ignore[attr-defined]
from typing import Any

import regex

PATTERN_BUDGET_S = 0.05  # of one request's pattern checks, compiles included
MAX_PATTERN_SIZE = 2_000  # nodes a pattern's counted repeats unroll to (`regex` compiles it in 20 ms or less)
# characters of a pattern read at all: parsing and compiling have no timeout, and a long class of
# escapes (63k characters, within the schema's size limit) took 75 ms past the budget
MAX_PATTERN_CHARS = 1_024


class PatternChecks:
    """One request's checks of texts against patterns, `budget_s` of time in all. It answers the
    same for the same pattern and text every time it is asked."""

    def __init__(self, budget_s: float = PATTERN_BUDGET_S) -> None:
        self._budget_s = budget_s
        self._spent_s = 0.0
        self._compiled: dict[str, Any] = {}  # pattern -> regex's Pattern, or None: not checked
        self._answers: dict[tuple[str, str], bool] = {}

    @property
    def is_spent(self) -> bool:
        return self._spent_s >= self._budget_s

    def allows(self, pattern: str, text: str) -> bool:
        """Whether `pattern` is found in `text` (searched, as JSON Schema does), or cannot be
        checked within the budget."""
        key = (pattern, text)
        if key not in self._answers:
            self._answers[key] = self._search(pattern, text)
        return self._answers[key]

    def _search(self, pattern: str, text: str) -> bool:
        compiled = self._compile(pattern)
        if compiled is None or self.is_spent:
            return True
        started = time.perf_counter()
        try:
            return compiled.search(text, timeout=self._budget_s - self._spent_s) is not None
        except TimeoutError:
            self._spent_s = self._budget_s  # (all that was left)
            return True
        finally:
            self._spent_s += time.perf_counter() - started

    def _compile(self, pattern: str) -> Any:
        """`pattern` compiled, or None where it is not checked (see the module's docstring)."""
        if pattern not in self._compiled:
            if self.is_spent:
                return None
            started = time.perf_counter()
            self._compiled[pattern] = _compiled(pattern)
            self._spent_s += time.perf_counter() - started
        return self._compiled[pattern]


def _compiled(pattern: str) -> Any:
    if len(pattern) > MAX_PATTERN_CHARS:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # (`[[`: a set nested in a later Python)
            size = _unrolled_size(re_parser.parse(pattern))
            return regex.compile(pattern) if size <= MAX_PATTERN_SIZE else None
    except (re.error, regex.error, OverflowError, RecursionError):
        return None


_REPEATS = frozenset({re_parser.MAX_REPEAT, re_parser.MIN_REPEAT, re_parser.POSSESSIVE_REPEAT})


def _unrolled_size(items: Any) -> int:
    """How many nodes the parsed pattern `items` (re's parser's `(op, argument)` list) unrolls to:
    a repeat's body as many times as it must match (once at least), a group's items, every
    alternative of a branch or a conditional."""
    size = 0
    for op, argument in items:
        if op in _REPEATS:
            least, _, body = argument
            size += max(least, 1) * _unrolled_size(body)
        elif op in (re_parser.SUBPATTERN, re_parser.ASSERT, re_parser.ASSERT_NOT, re_parser.ATOMIC_GROUP):
            size += _unrolled_size(argument if op == re_parser.ATOMIC_GROUP else argument[-1])
        elif op in (re_parser.BRANCH, re_parser.GROUPREF_EXISTS):
            parts = argument[1] if op == re_parser.BRANCH else argument[1:]
            size += sum(_unrolled_size(part) for part in parts if part is not None)
        else:
            size += 1
    return size
