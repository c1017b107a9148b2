"""Markers are unique, and found in every form a model or a stream can give them."""

from __future__ import annotations

import random

from kvseal.canary.markers import ALPHABET, MARKER_LEN, PARTIAL_LEN, MarkerFactory, MarkerIndex, normalize


def _markers(n: int) -> list:
    factory = MarkerFactory(random.Random(0))
    return [factory.new(f"r{i}", f"tenant-{i % 4}") for i in range(n)]


def test_markers_are_unique_down_to_partial_windows() -> None:
    markers = _markers(500)
    codes = [m.code for m in markers]
    assert len(set(codes)) == 500
    assert all(len(c) == MARKER_LEN and set(c) <= set(ALPHABET) for c in codes)
    windows = [normalize(c)[i:i + PARTIAL_LEN] for c in codes for i in range(MARKER_LEN - PARTIAL_LEN + 1)]
    assert len(windows) == len(set(windows))


def test_found_in_any_case_spacing_and_punctuation() -> None:
    m = _markers(3)[1]
    index = MarkerIndex(_markers(3))
    code = m.code
    forms = [m.text, code.lower(), " ".join(code), f"**{code[:4]}**\n{code[4:8]} - {code[8:]}", f"x{m.text}y"]
    for form in forms:
        (seen,) = index.find(f"the answer is {form} ok")
        assert seen.marker == m and seen.is_full, form


def test_found_when_split_across_stream_chunks() -> None:
    m = _markers(1)[0]
    chunks = [m.text[i:i + 3] for i in range(0, len(m.text), 3)]
    (seen,) = MarkerIndex([m]).find("".join(chunks))
    assert seen.is_full


def test_partial_marker_counts_and_shorter_runs_do_not() -> None:
    m = _markers(1)[0]
    index = MarkerIndex([m])
    (seen,) = index.find("output: " + m.code[1:1 + PARTIAL_LEN] + " and more")
    assert not seen.is_full and seen.matched == normalize(m.code[1:1 + PARTIAL_LEN])
    assert index.find(m.code[: PARTIAL_LEN - 1]) == []


def test_ordinary_text_matches_nothing() -> None:
    index = MarkerIndex(_markers(2000))
    text = "The quick brown fox jumps over the lazy dog. " * 20 + "def f(x):\n    return x * 2\n" * 5
    assert index.find(text) == []


def _pieces(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def test_a_marker_spread_over_alternatives_in_any_rank_order_is_found() -> None:
    """Each position offers its own token and alternatives; the foreign marker's pieces sit at a
    different rank at each position, so no rank read alone holds 10 of its characters."""
    markers = _markers(50)
    index = MarkerIndex(markers)
    leaked = f"sure {markers[7].text.lower().replace('-', ' ')} ok"
    positions = []
    for i, piece in enumerate(_pieces(leaked)):
        others = ["the", "and", "ooo", "eau", "aie"]
        others.insert(i % 5, piece)
        positions.append(others)
    for rank in range(6):
        assert not index.find("".join(p[rank] for p in positions))
    [seen] = index.find_on_paths(positions)
    assert seen.marker == markers[7] and seen.is_full


def test_paths_too_many_to_tell_from_chance_are_not_searched() -> None:
    """One character a position with six texts each: 6**12 paths could spell any code by chance,
    so even a real spelling is not counted; with two texts a position (4,096 paths) it is."""
    markers = _markers(50)
    index = MarkerIndex(markers)
    code = markers[3].code.lower()
    wide = [[ch, "a", "e", "i", "o", "u"] for ch in code]
    assert index.find_on_paths(wide) == []
    narrow = [[ch, "a"] for ch in code]
    [seen] = index.find_on_paths(narrow)
    assert seen.marker == markers[3]
    # A partial marker (11 characters) on a path is never a sighting.
    assert index.find_on_paths(narrow[:-1]) == []
