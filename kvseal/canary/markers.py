"""Canary markers: unique random codes per request, and finding them again in any form.

A marker is `MARKER_LEN` characters drawn from consonants and digits, shown in groups
("K7QX-M2PZ-4TRB"). Detection works on a normalized text (lower case, only letters and digits
kept), so a marker is found whatever the model did to its case, spacing or punctuation, and
whatever chunks a stream split it into. The alphabet has no vowels, so ordinary words never
look like a marker; a *partial* marker is any `PARTIAL_LEN` consecutive characters of one.

Token alternatives (logprobs' top alternatives, prompt_logprobs) are also searched in any rank
order (`MarkerIndex.find_on_paths`): a whole marker spelled by one text per position over
consecutive positions, each taken from any of that position's texts. Those positions offer many
paths, so a chance spelling is bounded by counting them: a match counts only where the positions
it spans offer at most `MAX_PATHS` paths, and only a whole marker counts, never a partial one.
With every text a random marker character, a chance match from one start position has
probability about MAX_PATHS x markers x (characters of the first text) / 28**12, under 1e-8 at
2000 markers; a run reads a few 10,000 positions, so well under 1e-3 per run.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

ALPHABET = "BCDFGHJKLMNPQRSTVWXZ23456789"
MARKER_LEN = 12
GROUP_LEN = 4
# Shortest run of a marker's characters that counts as a sighting. With 28 symbols a 10-char
# window has 28**10 ~ 3e14 values: a chance match is negligible even over millions of windows.
PARTIAL_LEN = 10
# The most paths (the product of each spanned position's count of distinct texts) a match in
# any rank order may span: 3-character tokens with 6 texts a position (5 positions, 7,776
# paths) are searched, one-character tokens with 6 texts a position (6**12 paths) are not.
MAX_PATHS = 65_536

_NOT_ALNUM = re.compile(r"[^0-9a-z]+")


def normalize(text: str) -> str:
    """Lower case, letters and digits only: the form every comparison is made in."""
    return _NOT_ALNUM.sub("", text.lower())


def display(code: str) -> str:
    """'K7QXM2PZ4TRB' -> 'K7QX-M2PZ-4TRB' (the form written into prompts)."""
    return "-".join(code[i:i + GROUP_LEN] for i in range(0, len(code), GROUP_LEN))


DISPLAY_LEN = MARKER_LEN + (MARKER_LEN - 1) // GROUP_LEN


@dataclass(frozen=True)
class Marker:
    """One request's marker. `code` is upper case without separators."""

    code: str
    request_id: str
    tenant: str

    @property
    def text(self) -> str:
        return display(self.code)


class MarkerFactory:
    """Draws markers that share no `PARTIAL_LEN` window with any marker drawn before, so every
    sighting names exactly one source request."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._windows: set[str] = set()

    def new(self, request_id: str, tenant: str) -> Marker:
        while True:
            code = "".join(self._rng.choice(ALPHABET) for _ in range(MARKER_LEN))
            windows = set(_windows(normalize(code)))
            if not windows & self._windows:
                self._windows |= windows
                return Marker(code, request_id, tenant)


@dataclass(frozen=True)
class Sighting:
    """A marker (or `PARTIAL_LEN`+ characters of one) found in a response."""

    marker: Marker
    matched: str  # the normalized characters that matched
    is_full: bool


class MarkerIndex:
    """Every marker of a run, looked up by its `PARTIAL_LEN`-character windows."""

    def __init__(self, markers: Iterable[Marker]) -> None:
        self._by_window: dict[str, Marker] = {}
        self._by_code: dict[str, Marker] = {}
        for marker in markers:
            self._by_code[normalize(marker.code)] = marker
            for window in _windows(normalize(marker.code)):
                self._by_window[window] = marker
        self._pieces: set[str] | None = None  # every run of fewer than MARKER_LEN characters of a code

    def find(self, text: str) -> list[Sighting]:
        """Every marker seen in `text`, once each, with the longest run of it that matched."""
        norm = normalize(text)
        best: dict[str, Sighting] = {}
        for start, marker in self._hits(norm):
            matched = _extend(norm, start, normalize(marker.code))
            seen = best.get(marker.request_id)
            if seen is None or len(matched) > len(seen.matched):
                best[marker.request_id] = Sighting(marker, matched, len(matched) == MARKER_LEN)
        return list(best.values())

    def find_on_paths(self, positions: Sequence[Sequence[str]]) -> list[Sighting]:
        """Every marker spelled whole (never a partial one) on a path through `positions`: one of
        each position's texts, over consecutive positions, in any rank order, where the spanned
        positions offer at most `MAX_PATHS` paths. Found once each. Not found: a marker whose
        pieces skip a position, share one position, or come in another order than its own."""
        found: dict[str, Sighting] = {}
        ends: dict[str, int] = {}  # a path's last characters that begin a code -> fewest paths spanned
        for texts in positions:
            options = {normalize(t) for t in texts}
            ends = self._step(ends | {"": 1}, options, found)
        return list(found.values())

    def _step(self, ends: dict[str, int], options: set[str], found: dict[str, Sighting]) -> dict[str, int]:
        """Extend every path end by every option; a path's state is the longest end of its text that
        is a run of some code (any longer run of the path ends in it, so nothing is lost)."""
        out: dict[str, int] = {}
        for end, num_paths in ends.items():
            num_paths *= len(options)
            if num_paths > MAX_PATHS:
                continue
            for option in options:
                text = end + option
                for start in range(len(text) - MARKER_LEN + 1):
                    marker = self._by_code.get(text[start:start + MARKER_LEN])
                    if marker is not None:
                        found[marker.request_id] = Sighting(marker, text[start:start + MARKER_LEN], True)
                piece = self._piece_end(text)
                if piece and num_paths < out.get(piece, MAX_PATHS + 1):
                    out[piece] = num_paths
        return out

    def _piece_end(self, text: str) -> str:
        if self._pieces is None:
            self._pieces = {code[i:j] for code in self._by_code for i in range(MARKER_LEN)
                            for j in range(i + 1, MARKER_LEN + 1) if j - i < MARKER_LEN}
        for size in range(min(len(text), MARKER_LEN - 1), 0, -1):
            if text[-size:] in self._pieces:
                return text[-size:]
        return ""

    def _hits(self, norm: str) -> Iterator[tuple[int, Marker]]:
        for start in range(len(norm) - PARTIAL_LEN + 1):
            marker = self._by_window.get(norm[start:start + PARTIAL_LEN])
            if marker is not None:
                yield start, marker


def _windows(norm_code: str) -> Iterator[str]:
    for start in range(len(norm_code) - PARTIAL_LEN + 1):
        yield norm_code[start:start + PARTIAL_LEN]


def _extend(norm: str, start: int, norm_code: str) -> str:
    """The longest run of `norm_code` (a contiguous piece of it) that covers norm[start:...]."""
    window = norm[start:start + PARTIAL_LEN]
    offset = norm_code.index(window)
    begin, code_begin = start, offset
    while begin > 0 and code_begin > 0 and norm[begin - 1] == norm_code[code_begin - 1]:
        begin, code_begin = begin - 1, code_begin - 1
    end, code_end = start + PARTIAL_LEN, offset + PARTIAL_LEN
    while end < len(norm) and code_end < len(norm_code) and norm[end] == norm_code[code_end]:
        end, code_end = end + 1, code_end + 1
    return norm[begin:end]
