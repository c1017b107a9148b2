"""The messages between the engine and its grammar worker processes, and their framing.

A worker reads `ToWorkerMsg`s on its stdin and writes `FromWorkerMsg`s on its stdout; each
message is one frame: a 4-byte big-endian length, then the msgpack of a frozen, tagged
msgspec Struct. Decoding accepts only the union registered for that direction.
"""

from __future__ import annotations

import os
import struct

import msgspec

MAX_FRAME_BYTES = 256 * 1024 * 1024  # a tokenizer description of a very large vocabulary fits
_LENGTH = struct.Struct(">I")


class _Msg(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    pass


class WorkerSetupMsg(_Msg, frozen=True):
    """First message to a new worker: the vocabulary it compiles against."""

    tokenizer_info_json: str  # xgrammar `TokenizerInfo.serialize_json()`, built once by the engine
    vocab_size: int


class WorkerReadyMsg(_Msg, frozen=True):
    """The worker has its compiler and takes grammars now."""

    pid: int


class JudgeGrammarMsg(_Msg, frozen=True):
    """Compile this structured-output spec (`StructuredOutput.kind`, `.schema`) and report."""

    kind: str
    schema: str | None


class GrammarJudgedMsg(_Msg, frozen=True):
    """The spec compiled (`error` None) or not (`error` names why, xgrammar's words)."""

    error: str | None
    compile_s: float


ToWorkerMsg = WorkerSetupMsg | JudgeGrammarMsg
FromWorkerMsg = WorkerReadyMsg | GrammarJudgedMsg

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorkerMsg)
_from_worker = msgspec.msgpack.Decoder(FromWorkerMsg)


class FrameError(Exception):
    """The other side closed the pipe, or sent something that is not a frame of this protocol."""


def write_frame(fd: int, msg: ToWorkerMsg | FromWorkerMsg) -> None:
    """Write one whole frame (blocking). Raises OSError (BrokenPipeError) if the reader is gone."""
    data = _encoder.encode(msg)
    view = memoryview(_LENGTH.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def read_to_worker(fd: int) -> ToWorkerMsg | None:
    """The next message for a worker; None once the engine closed the pipe."""
    data = _read_frame(fd)
    if data is None:
        return None
    try:
        return _to_worker.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"undecodable message to a grammar worker: {exc}") from None


def read_from_worker(fd: int) -> FromWorkerMsg:
    """The worker's next message (call when its pipe is readable). Raises `FrameError` if the
    worker is gone or wrote something else."""
    data = _read_frame(fd)
    if data is None:
        raise FrameError("the grammar worker closed its pipe")
    try:
        return _from_worker.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"undecodable message from a grammar worker: {exc}") from None


def _read_frame(fd: int) -> bytes | None:
    head = _read_exactly(fd, _LENGTH.size)
    if head is None:
        return None
    (size,) = _LENGTH.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"a grammar-worker frame of {size} bytes (the limit is {MAX_FRAME_BYTES})")
    body = _read_exactly(fd, size)
    if body is None:
        raise FrameError("the grammar-worker pipe closed inside a frame")
    return body


def _read_exactly(fd: int, size: int) -> bytes | None:
    """`size` bytes, or None at end of file before the first byte."""
    chunks: list[bytes] = []
    remaining = size
    while remaining:
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            if remaining == size:
                return None
            raise FrameError("the grammar-worker pipe closed inside a frame")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)
