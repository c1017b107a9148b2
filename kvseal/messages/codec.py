"""The one codec: msgpack via msgspec, decoding only into the registered message unions."""

from __future__ import annotations

import msgspec

from kvseal.messages.msgs import FromEngineMsg, ToEngineMsg

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngineMsg)
_from_engine = msgspec.msgpack.Decoder(FromEngineMsg)


def encode(msg: ToEngineMsg | FromEngineMsg) -> bytes:
    return _encoder.encode(msg)


def decode_to_engine(data: bytes) -> ToEngineMsg:
    """Raise `msgspec.DecodeError` (or `ValidationError`) for anything not a `ToEngineMsg`."""
    return _to_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngineMsg:
    """Raise `msgspec.DecodeError` (or `ValidationError`) for anything not a `FromEngineMsg`."""
    return _from_engine.decode(data)
