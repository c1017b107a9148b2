"""Structured output in PD mode: prefill samples the first token under the request's grammar;
decode compiles the same grammar (per tenant, cached), advances it by that token and
constrains the rest, so the output equals colocated generation and satisfies the grammar.

Both roles compile off their loops, in their grammar worker processes under the time budget:
the grammar scenario of tests/server/test_grammar_budget.py runs here against `serve --pd`
(its checks are shown failing under their faults there)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from char_model import END_THINK, THINK, make_char_model
from grammar_scenario import GrammarServer, check_b_not_behind_a, check_disconnect_cancels_the_compile
from grammar_schemas import SLOW_SCHEMA, spec
from pd_harness import Handoff, PdPair, SharedPair
from transports import NIXL

from kvseal import LLM, SamplingParams
from kvseal.config import EngineArgs
from kvseal.disagg.msgs import PrefillMsg, PrefillRefusedMsg
from kvseal.disagg.prefill import REQUEST_ABORTED
from kvseal.messages.convert import params_to_msg
from kvseal.messages.msgs import AbortMsg
from kvseal.models.loader import load_model
from kvseal.types import ReasoningGate, StructuredOutput

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
# One grammar worker per engine: these tests are about the handoff, not about fairness.
ENGINE = dict(kv_cache_tokens=1024, page_size=4, dtype="float32", grammar_compile_workers=1)


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_char_model(tmp_path_factory.mktemp("char") / "char-llama")


@pytest.fixture(scope="module")
def colocated(char_dir: Path) -> Iterator[LLM]:
    llm = LLM(str(char_dir), **ENGINE)  # type: ignore[arg-type]
    yield llm
    llm.engine.close()


@pytest.fixture(scope="module", params=["tcp", NIXL])
def shared_pair(char_dir: Path, request: pytest.FixtureRequest) -> Iterator[SharedPair]:
    """One pair per transport lent to one test after another (two engines and their grammar
    workers started once, not per test). Prefix caching is off: every test sends "hello", and one
    test's prompt must not be the next one's cache hit (on a new pair none of them ever was)."""
    def make(_: object) -> PdPair:
        args = EngineArgs(model=str(char_dir), enable_prefix_caching=False, **ENGINE)  # type: ignore[arg-type]
        return PdPair(args, args, loaded=load_model(str(char_dir), args.torch_dtype), kv_transport=request.param)

    shared = SharedPair(make)
    yield shared
    shared.close()


@pytest.fixture
def pair(shared_pair: SharedPair) -> Iterator[PdPair]:
    yield from shared_pair.lend()


@pytest.mark.parametrize("structured", [StructuredOutput("json_schema", json.dumps(SCHEMA)),
                                        StructuredOutput("json_object"),
                                        # vLLM's kinds travel as the same two strings: one stands for all three
                                        StructuredOutput("choice", json.dumps(["red", "green", "blue"]))])
def test_structured_output_in_pd_equals_colocated(pair: PdPair, colocated: LLM,
                                                  structured: StructuredOutput) -> None:
    params = SamplingParams(max_tokens=60, temperature=0, structured=structured)
    prompt = pair.decode.engine.tokenize("hello")
    handoff = pair.generate(prompt, params)
    assert handoff.final.finish_reason in ("stop", "length") and handoff.final.error is None, handoff.final
    expected = colocated.generate([prompt], params)[0]
    assert handoff.token_ids == expected.token_ids
    text = "".join(o.new_text for o in handoff.outputs)
    assert text == expected.text
    if structured.kind == "json_schema":  # this one completes within max_tokens
        assert handoff.final.finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    elif structured.kind == "json_object":  # greedy may run to max_tokens: a prefix of an object, then
        assert text.startswith("{")
    else:  # vLLM's choice kind crosses the handoff as it is
        assert handoff.final.finish_reason == "stop" and text in ("red", "green", "blue"), text
    pair.assert_clean()


def test_a_grammar_behind_a_reasoning_block_in_pd_equals_colocated(pair: PdPair, colocated: LLM) -> None:
    """Prefill samples `<think>` as the first token, which the regex alone forbids; decode's
    grammar has the same gate, so it takes that token as the block's start, and the regex holds
    after `</think>` in both roles' output alike."""
    gate = ReasoningGate(THINK, END_THINK, open_at_start=False)
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=5, logit_bias={1: -100.0, THINK: 3.0, END_THINK: 3.0},
                            structured=StructuredOutput("regex", "[a-z]{2}", reasoning=gate))
    prompt = pair.decode.engine.tokenize("hello")
    handoff = pair.generate(prompt, params)
    assert handoff.final.finish_reason == "stop" and handoff.final.error is None, handoff.final
    expected = colocated.generate([prompt], params)[0]
    assert handoff.token_ids == expected.token_ids and handoff.token_ids[0] == THINK
    reasoning, end, answer = expected.text.partition("</think>")
    assert end and re.fullmatch("[a-z]{2}", answer), expected.text
    pair.assert_clean()


def test_an_abort_while_the_grammar_compiles_cancels_it_in_either_role(pair: PdPair) -> None:
    """Decode holds a reservation request, and prefill a request, until its grammar compiled;
    an abort meanwhile ends it (nothing reserved, nothing computed) and stops the compile."""
    params = SamplingParams(max_tokens=4, temperature=0, structured=spec(SLOW_SCHEMA))
    prompt = pair.decode.engine.tokenize("hello")
    decode, prefill = pair.decode.engine, pair.prefill.engine
    cancelled_before = {role: engine.grammar_stats().num_cancelled for role, engine in
                        (("decode", decode), ("prefill", prefill))}  # the pair may be shared: counts as deltas
    handoff = pair.reserve(prompt, params, wait=False)
    pair.pump(lambda: decode.grammar_stats().num_running >= 1, "decode's compile to start")
    pair.to_decode.send(AbortMsg(handoff.request_id, "alice", "client_disconnected"))
    pair.pump(lambda: handoff.is_terminal, "the end of the aborted reservation request")
    assert handoff.reserved is None and handoff.final.finish_reason == "abort"
    pair.pump(lambda: decode.grammar_stats().num_cancelled == cancelled_before["decode"] + 1,
              "decode's compile to be stopped")

    request_id = "pd-prefill-compiling"
    started = pair.handoffs[request_id] = Handoff(request_id)
    num_pages = -(-(len(prompt) + 1) // prefill.kv.page_size)  # a well-formed message for no reservation
    pair.to_prefill.send(PrefillMsg(
        request_id, "alice", prompt, params_to_msg(params), transfer_id="0" * 32,
        decode_address=pair.decode.config.listen, decode_public_key=pair.decode.config.link_keys.own.public,
        decode_engine=pair.decode.instance_id, kv_address="unused", transfer_key=bytes(32),
        pages=list(range(num_pages))))
    pair.pump(lambda: prefill.grammar_stats().num_running >= 1, "prefill's compile to start")
    pair.to_prefill.send(AbortMsg(request_id, "alice", "client_disconnected"))
    pair.pump(lambda: started.prefill_result is not None, "prefill's answer")
    assert isinstance(started.prefill_result, PrefillRefusedMsg) and started.prefill_result.code == REQUEST_ABORTED
    pair.pump(lambda: prefill.grammar_stats().num_cancelled == cancelled_before["prefill"] + 1,
              "prefill's compile to be stopped")
    assert not prefill.has_unfinished()
    pair.assert_clean()


@pytest.fixture(scope="module")
def pd_server(char_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrammarServer]:
    server = GrammarServer(char_dir, tmp_path_factory.mktemp("pd-grammar-server"), pd=True).start()
    yield server
    server.terminate()


def test_another_tenants_small_grammar_is_not_held_up_in_pd(pd_server: GrammarServer) -> None:
    alone_s, waited_s = check_b_not_behind_a(pd_server)
    print(f"PD: tenant B's small-schema request took {waited_s:.3f} s while A's over-budget grammar "
          f"compiled ({alone_s:.3f} s alone)")


def test_a_client_that_leaves_stops_its_compile_in_pd(pd_server: GrammarServer) -> None:
    check_disconnect_cancels_the_compile(pd_server)


def test_keepalives_cover_a_request_whose_grammar_prefill_still_compiles(char_dir: Path) -> None:
    """Prefill keeps decode's reservation alive for a request whose grammar it still compiles, as
    for one it computes (keepalives every turn here, so some come while the compile runs), and the
    request runs to its end as usual."""
    args = EngineArgs(model=str(char_dir), enable_prefix_caching=False, **ENGINE)  # type: ignore[arg-type]
    pair = PdPair(args, args, loaded=load_model(str(char_dir), args.torch_dtype), keepalive_interval_s=0.001)
    try:
        params = SamplingParams(max_tokens=20, temperature=0, structured=StructuredOutput("json_schema",
                                                                                          json.dumps(SCHEMA)))
        handoff = pair.generate(pair.decode.engine.tokenize("hello"), params)
        assert handoff.final.error is None and handoff.final.finish_reason in ("stop", "length"), handoff.final
        pair.assert_clean()
    finally:
        pair.close()
