"""Canary markers: unique random codes per request, and finding them again in any form.

A marker is `MARKER_LEN` characters drawn from consonants and digits, shown in groups
("K7QX-M2PZ-4TRB"). Detection works on a normalized text (lower case, only letters and digits
kept), so a marker is found whatever the model did to its case, spacing or punctuation, and
whatever chunks a stream split it into. The alphabet has no vowels, so ordinary words never
look like a marker; a *partial* marker is any `PARTIAL_LEN` consecutive characters of one.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

ALPHABET = "BCDFGHJKLMNPQRSTVWXZ23456789"
MARKER_LEN = 12
GROUP_LEN = 4
# Shortest run of a marker's characters that counts as a sighting. With 28 symbols a 10-char
# window has 28**10 ~ 3e14 values: a chance match is negligible even over millions of windows.
PARTIAL_LEN = 10

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
        for marker in markers:
            for window in _windows(normalize(marker.code)):
                self._by_window[window] = marker

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
