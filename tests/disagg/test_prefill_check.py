"""A prefill engine checks every field of a `PrefillMsg` before it uses one: a value msgspec's
types allow but prefill cannot use (the audit's negative `num_cached_tokens` ended the engine
loop, a short `decode_public_key` ended it and hung the process) is refused to the sender with
`invalid_prefill_message`, naming the field; prefill contacts nothing the message names, and
keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from pd_harness import Handoff, PdPair
from test_handoff import GREEDY, args

from kvseal.disagg.msgs import INVALID_PREFILL_MSG, TRANSFER_FAILED, PrefillMsg, PrefillRefusedMsg
from kvseal.messages.msgs import AbortMsg
from kvseal.models.loader import load_model

PROMPT = list(range(100, 130))
NUM_PAGES = 8  # PROMPT's 30 tokens and the first output token, in pages of 4


@pytest.fixture(scope="module")
def pair(llama_dir: Path) -> Iterator[PdPair]:
    pair = PdPair(args(llama_dir), args(llama_dir), loaded=load_model(str(llama_dir), args(llama_dir).torch_dtype))
    yield pair
    pair.close()


def malformed(pair: PdPair, field: str) -> dict[str, Any]:
    """The audit's values and their neighbours, by the field they break."""
    keys = pair.keys
    return {
        "num_cached_tokens": [-16, 10**6, 2, 32],  # negative, past the prompt, not page-aligned, the whole prompt
        "decode_public_key": [b"short", b"~" * 40, keys.frontend.public, keys.prefill.public],
        "decode_address": ["not-an-address", "nohost:99999", "127.0.0.1:0", "a b:80", ":80"],
        "pages": [[], [10**9, -1], [*range(NUM_PAGES - 1), -1], [0] * NUM_PAGES, list(range(NUM_PAGES + 1))],
        "transfer_key": [b"", b"k" * 31],
        "transfer_id": ["", "x" * 32, "A" * 32],
        "request_id": ["", "r" * 257],
        "tenant": [""],
        "decode_engine": ["", "d" * 257],
        "kv_address": [""],
    }[field]


FIELDS = ["num_cached_tokens", "decode_public_key", "decode_address", "pages", "transfer_key", "transfer_id",
          "request_id", "tenant", "decode_engine", "kv_address"]


@pytest.mark.parametrize("field", FIELDS)
def test_a_malformed_prefill_msg_is_refused_to_its_sender_and_prefill_keeps_serving(pair: PdPair,
                                                                                      field: str) -> None:
    for value in malformed(pair, field):
        handoff = pair.reserve(PROMPT, GREEDY)
        good = pair.prefill_msg(handoff, PROMPT, GREEDY)
        refused = send(pair, msgspec.structs.replace(good, **{field: value}))
        assert refused.code == INVALID_PREFILL_MSG and field in refused.message, (value, refused)
        assert not pair.prefill.engine.has_unfinished()
        end_reservation(pair, handoff, good)  # what the frontend does on this refusal
    served = pair.generate(PROMPT, GREEDY)  # the engine still serves, and nothing leaked
    assert served.final.finish_reason == "length" and len(served.token_ids) == GREEDY.max_tokens
    pair.assert_clean()


def test_a_kv_address_the_tcp_transport_cannot_use_fails_the_transfer_only(pair: PdPair) -> None:
    """The KV address's form is the transport's: a malformed one fails that transfer (it once
    raised out of the loop from ZMQ's connect on the tcp transport)."""
    handoff = pair.reserve(PROMPT, GREEDY)
    good = pair.prefill_msg(handoff, PROMPT, GREEDY)
    refused = send(pair, msgspec.structs.replace(good, kv_address="x:y"))
    assert refused.code == TRANSFER_FAILED and "x:y" in refused.message, refused
    pair.pump(lambda: handoff.is_terminal, "decode's release")  # prefill told decode: its address was well-formed
    assert handoff.rejected is not None and handoff.rejected.code == TRANSFER_FAILED
    assert pair.generate(PROMPT, GREEDY).final.finish_reason == "length"
    pair.assert_clean()


def send(pair: PdPair, msg: PrefillMsg) -> PrefillRefusedMsg:
    """Send `msg` to prefill as the frontend; its answer."""
    handoff = pair.handoffs.setdefault(msg.request_id, Handoff(msg.request_id))
    handoff.prefill_result = None
    pair.to_prefill.send(msg)
    pair.pump(lambda: handoff.prefill_result is not None, "prefill's answer")
    assert isinstance(handoff.prefill_result, PrefillRefusedMsg), handoff.prefill_result
    return handoff.prefill_result


def end_reservation(pair: PdPair, handoff: Handoff, good: PrefillMsg) -> None:
    pair.to_decode.send(AbortMsg(good.request_id, good.tenant, "prefill refused the handoff"))
    pair.pump(lambda: handoff.is_terminal, "decode's release")
    assert handoff.final.finish_reason == "abort"
