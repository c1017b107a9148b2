"""The codec round-trips every message and refuses anything outside the registries."""

from __future__ import annotations

import msgspec
import pytest

from kvseal.messages.codec import decode_from_engine, decode_to_engine, encode
from kvseal.messages.convert import params_from_msg, params_to_msg
from kvseal.messages.msgs import (
    AbortMsg,
    AddRequestMsg,
    EngineFailedMsg,
    EngineReadyMsg,
    EngineStatsMsg,
    EngineStoppedMsg,
    OutputsMsg,
    RequestOutputMsg,
    RequestRejectedMsg,
    ShutdownMsg,
    TokenLogprobsMsg,
)
from kvseal.types import SamplingParams

PARAMS = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=11, stop=("x", "yz"),
                        stop_token_ids=(4,), ignore_eos=True, min_tokens=2, logprobs=3, truncate_prompt_tokens=9,
                        min_p=0.05, include_stop_str_in_output=True, skip_special_tokens=False)
OUTPUT = RequestOutputMsg("r1", "alice", [5, 6], " w5 w6", True, "stop", "yz", 3, 2, 1, 4,
                          [TokenLogprobsMsg(5, -0.5, [(5, -0.5), (9, -1.5)])], None)
TO_ENGINE = [AddRequestMsg("r1", "alice", [1, 2, 3], params_to_msg(PARAMS)), AbortMsg("r1", "alice", "why"),
             ShutdownMsg("stop")]
FROM_ENGINE = [
    EngineReadyMsg(1, "m", "/m", "/m", "LlamaForCausalLM", 512, 2048, 512, 4, 512, "off"),
    EngineFailedMsg("ConfigError", "too small"), EngineStoppedMsg(2),
    RequestRejectedMsg("r1", "alice", "context_length_exceeded", "too long", "prompt", 400),
    OutputsMsg([OUTPUT]), EngineStatsMsg(1, 2, 3, 4, 5, 6, 7),
]


@pytest.mark.parametrize("msg", TO_ENGINE)
def test_to_engine_round_trip(msg: object) -> None:
    assert decode_to_engine(encode(msg)) == msg  # type: ignore[arg-type]


@pytest.mark.parametrize("msg", FROM_ENGINE)
def test_from_engine_round_trip(msg: object) -> None:
    assert decode_from_engine(encode(msg)) == msg  # type: ignore[arg-type]


def test_each_direction_refuses_the_other_directions_messages() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_to_engine(encode(EngineStatsMsg(1, 2, 3, 4, 5)))
    with pytest.raises(msgspec.ValidationError):
        decode_from_engine(encode(ShutdownMsg("x")))


def test_unknown_or_malformed_messages_are_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_to_engine(msgspec.msgpack.encode({"type": "EvalMsg", "code": "1"}))
    with pytest.raises(msgspec.ValidationError):
        decode_to_engine(msgspec.msgpack.encode({"type": "AbortMsg", "request_id": "r", "tenant": "t",
                                                 "reason": "x", "extra": 1}))
    with pytest.raises(msgspec.DecodeError):
        decode_from_engine(b"\xc1")


def test_sampling_params_survive_the_trip() -> None:
    assert params_from_msg(params_to_msg(PARAMS)) == PARAMS
