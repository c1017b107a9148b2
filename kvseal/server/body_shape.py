"""How many JSON containers and object members a body holds, counted before it is parsed.

The parse (pydantic's, in Rust) builds a Python object for every value, and where it builds
them without calling back into Python (an `Any` field, an unknown field it reports, a dict it
validates entry by entry) it holds the GIL throughout, whichever thread it runs on: 3.9 million
empty arrays in an unknown field held it 3.7 s, a million metadata keys 0.9 s (measured). So a
body may hold at most `MAX_BODY_CONTAINERS` objects and arrays together and
`MAX_BODY_MEMBERS` key-value pairs, far above what a real request holds (a 2,048-message
conversation with a content part and a tool call in each: ~10,000 containers, ~25,000 members)
and low enough that building them holds the GIL ~0.1 s at most.

The count reads the bytes, not a parse: a body with no more brackets and colons than the limits
passes at once; another is scanned in slices (numpy, which lets the GIL go) for the brackets
and colons outside its strings. Invalid JSON is counted as if it were valid, and the parse that
follows refuses it; one nested deeper than `MAX_JSON_DEPTH` is refused as the parser would
refuse it (`invalid_json`), a more useful answer than its count of arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvseal.server import errors

MAX_BODY_CONTAINERS = 32_768  # JSON objects and arrays, together
MAX_BODY_MEMBERS = 131_072  # key-value pairs of all its objects
MAX_JSON_DEPTH = 200  # objects and arrays nested in each other: the parser's own limit (~200) rounded down
_SLICE_BYTES = 1 << 20  # scanned at a time: the GIL is free to other threads between slices
_QUOTE, _COLON = b'"'[0], b":"[0]
_OPENS, _CLOSES = (b"{"[0], b"["[0]), (b"}"[0], b"]"[0])


@dataclass(frozen=True)
class BodyShape:
    num_containers: int  # objects and arrays
    num_members: int  # key-value pairs of objects
    max_depth: int  # of objects and arrays nested in each other


def check_body_shape(data: bytes) -> None:
    """Raise `ApiError` 400 `body_too_complex` when the body holds more containers or members
    than the limits (`invalid_json` when it nests them deeper than JSON may be nested here)."""
    num_containers, num_members = data.count(b"{") + data.count(b"["), data.count(b":")  # strings' ones too
    if num_containers <= MAX_BODY_CONTAINERS and num_members <= MAX_BODY_MEMBERS:
        return
    shape = body_shape(data)
    if shape.max_depth > MAX_JSON_DEPTH:
        raise errors.invalid_json(f"objects and arrays nested {shape.max_depth} deep; the limit is {MAX_JSON_DEPTH}")
    if shape.num_containers > MAX_BODY_CONTAINERS:
        raise errors.body_too_complex(f"{shape.num_containers} JSON objects and arrays", MAX_BODY_CONTAINERS)
    if shape.num_members > MAX_BODY_MEMBERS:
        raise errors.body_too_complex(f"{shape.num_members} object members (key-value pairs)", MAX_BODY_MEMBERS)


def body_shape(data: bytes) -> BodyShape:
    """The containers, members and nesting outside the JSON text's strings. With `\\\\` and
    `\\"` blanked out, every quote left opens or closes a string, so a byte is inside one when an
    odd number of quotes comes before it."""
    text = np.frombuffer(data.replace(b"\\\\", b"__").replace(b'\\"', b"__"), dtype=np.uint8)
    num_containers = num_members = max_depth = 0
    num_quotes_before = depth_before = 0
    for start in range(0, len(text), _SLICE_BYTES):
        chunk = text[start:start + _SLICE_BYTES]
        quotes = np.cumsum(chunk == _QUOTE, dtype=np.int64) + num_quotes_before
        # a quote byte itself counts as inside or outside; it is neither bracket nor colon
        outside = (quotes & 1) == 0
        opens = _either(chunk, _OPENS) & outside
        depth = np.cumsum(opens, dtype=np.int64) - np.cumsum(_either(chunk, _CLOSES) & outside) + depth_before
        num_containers += int(np.count_nonzero(opens))
        num_members += int(np.count_nonzero((chunk == _COLON) & outside))
        max_depth = max(max_depth, int(depth.max()))
        num_quotes_before, depth_before = int(quotes[-1]), int(depth[-1])
    return BodyShape(num_containers, num_members, max_depth)


def _either(chunk: np.ndarray, pair: tuple[int, int]) -> np.ndarray:
    return (chunk == pair[0]) | (chunk == pair[1])
