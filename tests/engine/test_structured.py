"""Structured output offline: grammar-constrained JSON, schema errors, the per-tenant cache."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from char_model import END_THINK, THINK, make_char_model

from kvseal import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from kvseal.config import EngineArgs, GrammarConfig
from kvseal.errors import ConfigError, InvalidParameter
from kvseal.structured import compiler
from kvseal.structured.compiler import GrammarCompilerPool
from kvseal.structured.schema import (
    MAX_CHOICES,
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_PROPERTIES,
    check_schema,
    check_spec,
    check_tools,
    json_depth,
)
from kvseal.types import (
    NO_TOKEN_LEFT_GRAMMAR,
    NO_TOKEN_SATISFIES_CONSTRAINTS,
    ReasoningGate,
    RequestOutput,
    StructuredOutput,
    no_token_param,
)

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "colour", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def char_llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    folder = make_char_model(tmp_path_factory.mktemp("char") / "char-llama")
    llm = LLM(str(folder), kv_cache_tokens=1024, page_size=4, dtype="float32")
    yield llm
    llm.engine.close()


def test_json_schema_outputs_validate_in_a_mixed_batch(char_llm: LLM) -> None:
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=60, temperature=t, seed=s, structured=spec)
              for t, s in [(0.0, None), (1.0, 1), (1.5, 2), (2.0, 3)]]
    free = SamplingParams(max_tokens=20, temperature=1.0, seed=4, ignore_eos=True)
    outputs = char_llm.generate(["hi", "hello", "x", "{", "free"], [*params, free])
    for out in outputs[:-1]:
        assert out.finish_reason.value == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len(outputs[-1].token_ids) == 20, "a request without a grammar in the same batch is unconstrained"
    char_llm.engine.check_integrity()


def test_json_object_output_is_an_object(char_llm: LLM) -> None:
    spec = StructuredOutput("json_object")
    for seed in range(3):
        out = char_llm.generate("w", SamplingParams(max_tokens=200, temperature=0.7, seed=seed, structured=spec))[0]
        if out.finish_reason.value == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:  # cut by max_tokens: every token so far was allowed, so it is a prefix of an object
            assert out.text.startswith("{")


TOOL_CALL = {"type": "object", "properties": {"name": {"const": "f"}, "arguments": {
    "type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}},
    "required": ["name", "arguments"]}


@pytest.mark.parametrize(("spec", "min_tokens"), [
    (StructuredOutput("json_schema", '{"type": "boolean"}'), 20),
    (StructuredOutput("json_schema", '{"enum": ["a"]}'), 5),
    (StructuredOutput("json_object"), 30),
    (StructuredOutput("tool_call", json.dumps(TOOL_CALL)), 80),
])
@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (1.0, 0)])
def test_a_complete_answer_ends_the_request_before_min_tokens(
        spec: StructuredOutput, min_tokens: int, temperature: float, seed: int | None, char_llm: LLM) -> None:
    """The grammar wins over min_tokens: once it allows only the end, the request stops with its
    answer, the same one as without min_tokens (the grammar never allowed the end earlier),
    never an abort for a token the grammar refuses."""
    def run(min_tokens: int) -> RequestOutput:
        return char_llm.generate("hi", SamplingParams(max_tokens=120, min_tokens=min_tokens, temperature=temperature,
                                                      seed=seed, structured=spec))[0]

    free, held = run(0), run(min_tokens)
    assert (held.finish_reason.value, held.stop_reason, held.error) == ("stop", None, None), held.text
    assert len(held.token_ids) < min_tokens, "the case under test: the answer is shorter than min_tokens"
    assert (held.text, held.token_ids) == (free.text, free.token_ids)
    char_llm.engine.check_integrity()


def test_min_tokens_holds_the_end_while_the_grammar_allows_more(char_llm: LLM) -> None:
    """An integer in [1, 99]: after one digit the grammar allows the end or a second digit, so
    min_tokens bans the end; after two only the end is left, and the request stops there."""
    spec = StructuredOutput("json_schema", json.dumps({"type": "integer", "minimum": 1, "maximum": 99}))
    seeds = range(8)
    free = char_llm.generate(["hi"] * len(seeds), [SamplingParams(max_tokens=30, temperature=1.0, seed=s,
                                                                  structured=spec) for s in seeds])
    held = char_llm.generate(["hi"] * len(seeds), [SamplingParams(max_tokens=30, min_tokens=5, temperature=1.0, seed=s,
                                                                  structured=spec) for s in seeds])
    assert any(len(out.text) == 1 for out in free), "without min_tokens some answers are one digit"
    for out in held:
        assert out.finish_reason.value == "stop" and len(out.text) == 2 and 10 <= int(out.text) <= 99, out.text
    char_llm.engine.check_integrity()


@pytest.mark.parametrize(("schema", "problem"), [
    ('{"type": "objectx"}', "objectx"),
    ('{"type": "object", "properties": 5}', "properties"),
])
def test_invalid_schema_is_a_typed_error_naming_the_problem(schema: str, problem: str, char_llm: LLM) -> None:
    with pytest.raises(InvalidParameter, match=problem) as info:
        check_schema(schema)
    assert info.value.param == "response_format"
    with pytest.raises(InvalidParameter, match=problem):
        char_llm.generate("x", SamplingParams(structured=StructuredOutput("json_schema", schema)))
    assert not char_llm.engine.has_unfinished()


# Schemas with a keyword xgrammar drops or compiles into something else: (schema, an instance on
# which its grammar and a JSON Schema validator disagree, what the refusal names)
UNENFORCED_SCHEMAS = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "'uniqueItems' at the top"),
    ({"type": "integer", "not": {"const": 3}}, "3", "'not' at the top"),
    ({"type": "integer", "if": {"minimum": 0}, "then": {"maximum": -1}}, "5", "'if' at the top"),
    ({"type": "array", "contains": {"const": "z"}}, '["z"]', "'contains' at the top"),
    ({"allOf": [{"type": "integer"}, {"minimum": 500}]}, "5", "'allOf' over 2 schemas at the top"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "'dependentRequired' at the top"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}', "'dependentSchemas' at the top"),
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}, '{"tags": [1]}',
     "'uniqueItems' at /properties/tags"),
]


@pytest.mark.parametrize(("schema", "instance", "named"), UNENFORCED_SCHEMAS)
def test_a_keyword_the_grammar_cannot_enforce_is_refused_not_dropped(
        schema: dict[str, Any], instance: str, named: str, char_llm: LLM) -> None:
    """xgrammar compiles these schemas as if the keyword were not there, or as something else:
    output breaking the schema would come back with a 200. Refused at the door and offline."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    valid = jsonschema.Draft202012Validator(schema).is_valid(json.loads(instance))
    assert _is_grammar_accept_string(grammar, instance) != valid  # the premise: the grammar gets it wrong
    with pytest.raises(InvalidParameter, match=re.escape(named)) as info:
        check_schema(json.dumps(schema))
    assert info.value.param == "response_format" and "cannot enforce" in str(info.value)
    with pytest.raises(InvalidParameter, match=re.escape(named)):
        char_llm.generate("x", SamplingParams(structured=StructuredOutput("json_schema", json.dumps(schema))))
    assert not char_llm.engine.has_unfinished()


def test_keywords_the_grammar_enforces_and_annotations_pass() -> None:
    check_schema(json.dumps({"type": "object", "title": "T", "description": "d", "properties": {
        "n": {"type": "integer", "multipleOf": 3, "minimum": 0, "default": 3, "examples": [3]},
        "not": {"type": "string", "format": "password"},  # a property named "not"; an annotation format
        "when": {"type": "string", "format": "date-time"},
        "tags": {"type": "array", "uniqueItems": False, "items": {"allOf": [{"type": "string"}]}},
        "pairs": {"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": {"type": "string"}}},
        "required": ["n"], "unevaluatedProperties": False}))


def test_grammar_cache_is_per_tenant(char_llm: LLM) -> None:
    pool = GrammarCompilerPool(char_llm.get_tokenizer(), 128, (1,), GrammarConfig(num_workers=1))
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    first = pool.compile_now("alice", spec)
    assert pool.num_compiles == 1
    assert pool.compile_now("alice", spec) is first and pool.num_compiles == 1, "same tenant: a hit"
    assert pool.compile_now("bob", spec) is not first and pool.num_compiles == 2, "another tenant: a miss"
    pool.close()


def test_a_tenant_sending_many_grammars_evicts_its_own_not_another_tenants(
        char_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache is shared by size, not by order: past its size the tenant holding the most
    loses its least recently used grammar, so alice's flood of distinct grammars never costs
    bob (holding one) a recompile, and her own oldest goes."""
    monkeypatch.setattr(compiler, "CACHE_ENTRIES", 4)
    pool = GrammarCompilerPool(char_llm.get_tokenizer(), 128, (1,), GrammarConfig(num_workers=1))
    try:
        def titled(title: str) -> StructuredOutput:
            return StructuredOutput("json_schema", json.dumps(SCHEMA | {"title": title}))

        bobs = pool.compile_now("bob", titled("bob"))
        for i in range(6):
            pool.compile_now("alice", titled(f"alice-{i}"))
        assert pool.num_compiles == 7
        assert pool.compile_now("bob", titled("bob")) is bobs and pool.num_compiles == 7, "bob's stayed"
        pool.compile_now("alice", titled("alice-5"))
        assert pool.num_compiles == 7, "alice's most recent stayed"
        pool.compile_now("alice", titled("alice-0"))
        assert pool.num_compiles == 8, "alice's oldest went"
    finally:
        pool.close()


def test_structured_params_round_trip_through_messages(tmp_path: Path) -> None:
    from kvseal.messages.convert import params_from_msg, params_to_msg

    params = SamplingParams(structured=StructuredOutput("json_schema", "{}"), n=2, logit_bias={3: 1.0})
    assert params_from_msg(params_to_msg(params)) == params
    with pytest.raises(InvalidParameter):
        StructuredOutput("json_schema")


def test_a_grammar_the_vocabulary_cannot_begin_is_refused(make_llm: Any) -> None:
    """The word-level tiny model has no token that spells "{": a 400, never an aborted request."""
    llm = make_llm()
    with pytest.raises(InvalidParameter, match="no token that can begin") as info:
        llm.generate("w5", SamplingParams(structured=StructuredOutput("json_object")))
    assert info.value.param == "response_format" and not llm.engine.has_unfinished()
    llm.engine.close()


def test_a_grammar_the_vocabulary_cannot_continue_ends_the_request_with_a_typed_error(make_llm: Any) -> None:
    """The word-level tiny model can begin "(w8 )+w9" but has no token for the space after "w8":
    the request ends there with `no_token_satisfies_constraints`, saying the vocabulary cannot
    continue the grammar, never with a token the grammar refused (it used to sample token 0 and
    be aborted as an engine fault, a 500); its batch neighbour runs on."""
    llm = make_llm()
    regex = SamplingParams(max_tokens=8, temperature=0.7, seed=1, structured=StructuredOutput("regex", "(w8 )+w9"))
    out, neighbour = llm.generate(["w4", "w5"], [regex, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)])
    assert (out.token_ids, out.finish_reason.value, out.error_code) == ([8], "abort", NO_TOKEN_SATISFIES_CONSTRAINTS)
    assert out.error == NO_TOKEN_LEFT_GRAMMAR and no_token_param(out.error) is None
    assert len(neighbour.token_ids) == 5 and neighbour.error is None
    everything = dataclasses.replace(regex, allowed_token_ids=tuple(range(512)))  # allowed_token_ids is no cause
    [out] = llm.generate(["w4"], everything)
    assert (out.token_ids, out.error_code, out.error) == ([8], NO_TOKEN_SATISFIES_CONSTRAINTS, NO_TOKEN_LEFT_GRAMMAR)
    llm.engine.check_integrity()
    assert llm.engine.stats().num_pages_used == 0
    llm.engine.close()


# ---- the door checks on a schema, and the budget's configuration ---------------------------

def test_json_depth_skips_brackets_inside_strings() -> None:
    assert json_depth('{"a": [1, {"b": "[[[{{{"}]}') == 3
    assert json_depth('"{[}]"') == 0


@pytest.mark.parametrize(("schema", "problem"), [
    ("[" * (MAX_SCHEMA_DEPTH + 1) + "]" * (MAX_SCHEMA_DEPTH + 1), f"deep; the limit is {MAX_SCHEMA_DEPTH}"),
    (json.dumps({"type": "object", "properties": {str(i): {} for i in range(MAX_SCHEMA_PROPERTIES + 1)}}),
     f"properties; the limit is {MAX_SCHEMA_PROPERTIES}"),
    ('{"type": "string", "description": "' + "x" * MAX_SCHEMA_CHARS + '"}', f"the limit is {MAX_SCHEMA_CHARS}"),
    ('{"type": ', "not valid JSON"),
])
def test_schemas_over_a_door_bound_are_refused_naming_it(schema: str, problem: str) -> None:
    with pytest.raises(InvalidParameter, match=problem) as info:
        check_schema(schema)
    assert info.value.param == "response_format"


def test_tools_get_the_bounds_and_grammar_tools_the_full_check() -> None:
    unsupported = {"type": "objectx"}  # xgrammar cannot build it; a template can still render it
    tools = [{"type": "function", "function": {"name": "f", "parameters": unsupported}}]
    check_tools(tools, frozenset())  # tool_choice auto: rendered, no grammar built from it
    with pytest.raises(InvalidParameter, match=r"tools\[0\].function.parameters: .*objectx") as info:
        check_tools(tools, frozenset({"f"}))  # required / named: the grammar is built from it
    assert info.value.param == "tools"
    nested = {"type": "array", "items": {}}
    for _ in range(MAX_SCHEMA_DEPTH):
        nested = {"type": "array", "items": nested}
    with pytest.raises(InvalidParameter, match=f"the limit is {MAX_SCHEMA_DEPTH}"):
        check_tools([{"type": "function", "function": {"name": "g", "parameters": nested}}], frozenset())


@pytest.mark.parametrize(("field", "value", "flag"), [
    ("grammar_compile_timeout_s", 0, "--grammar-compile-timeout-s"),
    ("grammar_compile_timeout_s", float("inf"), "--grammar-compile-timeout-s"),
    ("grammar_compile_workers", 0, "--grammar-compile-workers"),
    ("grammar_compile_workers", 1.5, "--grammar-compile-workers"),
])
def test_a_bad_grammar_budget_is_refused_naming_the_flag(field: str, value: Any, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        EngineArgs(**{field: value})


def test_llm_takes_the_grammar_budget() -> None:
    assert EngineArgs(grammar_compile_timeout_s=2.5).grammar_config == GrammarConfig(2.5, 2)
    with pytest.raises(ConfigError, match="--grammar-compile-timeout-s"):
        LLM("unused", grammar_compile_timeout_s=-1)  # refused before any model is read


# ---- vLLM's other structured outputs: regex, choice, EBNF grammar ------------------------------

CHOICES = ["yes", "no", 'maybe "so"', "tab\there"]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
GRAMMAR = 'root ::= "(" item ("," item)? ")"\nitem ::= [a-c] [a-c]?'


@pytest.mark.parametrize("name", ["structured_outputs", "guided_decoding"])
def test_regex_choice_and_grammar_outputs_match_in_a_mixed_batch(char_llm: LLM, name: str) -> None:
    """vLLM's `StructuredOutputsParams` (and its older name, `GuidedDecodingParams` with
    `guided_decoding=`): each sampled output matches its own spec, beside a JSON request and an
    unconstrained one in the same batch."""
    specs = [StructuredOutputsParams(choice=CHOICES), GuidedDecodingParams(regex=REGEX),
             StructuredOutputsParams(grammar=GRAMMAR), StructuredOutputsParams(json=SCHEMA)]
    outputs = []
    for seed in range(3):
        params = [SamplingParams(max_tokens=60, temperature=1.2, seed=seed, **{name: spec}) for spec in specs]
        free = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
        outputs.append(char_llm.generate(["a", "b", "c", "d", "free"], [*params, free]))
    for choice, regex, grammar, as_json, free_out in outputs:
        assert all(o.finish_reason.value == "stop" for o in (choice, regex, grammar, as_json))
        assert choice.text in CHOICES
        assert re.fullmatch(REGEX, regex.text)
        assert re.fullmatch(r"\([a-c]{1,2}(,[a-c]{1,2})?\)", grammar.text)
        jsonschema.validate(json.loads(as_json.text), SCHEMA)
        assert len(free_out.token_ids) == 12
    assert len({o[0].text for o in outputs} | {o[1].text for o in outputs}) > 2, "sampled, not one fixed answer"
    char_llm.engine.check_integrity()


@pytest.mark.parametrize(("spec", "problem"), [
    (StructuredOutputsParams(), "exactly one"),
    (StructuredOutputsParams(regex="a", choice=["b"]), "exactly one"),
    (StructuredOutputsParams(choice=[]), "non-empty list"),
    (StructuredOutputsParams(choice=["a", ""]), "non-empty list"),
    (StructuredOutputsParams(regex=""), "non-empty string"),
    (StructuredOutputsParams(json=5), "JSON Schema"),  # type: ignore[arg-type]
])
def test_a_malformed_spec_is_refused_naming_it(spec: StructuredOutputsParams, problem: str) -> None:
    with pytest.raises(InvalidParameter, match=problem) as info:
        SamplingParams(structured_outputs=spec)
    assert info.value.param == "structured_outputs"


def test_two_specs_in_one_request_are_refused() -> None:
    with pytest.raises(InvalidParameter, match="not both"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"),
                       guided_decoding=StructuredOutputsParams(regex="a"))
    with pytest.raises(InvalidParameter, match="different grammars"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"),
                       structured=StructuredOutput("json_object"))
    with pytest.raises(InvalidParameter, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]


@pytest.mark.parametrize(("spec", "param", "problem"), [
    (StructuredOutputsParams(regex="([a-"), "guided_regex", "Unclosed"),
    (StructuredOutputsParams(grammar="root ::= missing"), "guided_grammar", "missing"),
])
def test_a_spec_xgrammar_cannot_read_is_a_typed_error(char_llm: LLM, spec: StructuredOutputsParams, param: str,
                                                      problem: str) -> None:
    with pytest.raises(InvalidParameter, match=problem) as info:
        char_llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=spec))
    assert info.value.param == param
    assert not char_llm.engine.has_unfinished()


@pytest.mark.parametrize("spec", ['[{"name": "f"}]', '{"a": 1}', "[]", '[{"name": 3, "parameters": {}}]'])
def test_a_malformed_qwen3_coder_call_spec_is_a_typed_error_not_a_workers_crash(char_llm: LLM, spec: str) -> None:
    """Offline callers may write a qwen3_coder_call spec themselves: a malformed one is refused
    naming the shape it needs (a worker that crashed on it would say it stopped while compiling)."""
    params = SamplingParams(max_tokens=4, structured=StructuredOutput("qwen3_coder_call", spec))
    with pytest.raises(InvalidParameter, match="non-empty JSON list"):
        char_llm.generate("x", params)
    assert not char_llm.engine.has_unfinished()


@pytest.mark.parametrize(("spec", "problem"), [
    (StructuredOutput("regex", "([a-"), "Unclosed"),
    (StructuredOutput("regex", "a" * (MAX_SCHEMA_CHARS + 1)), "limit"),
    (StructuredOutput("grammar", "root ::= missing"), "missing"),
    (StructuredOutput("choice", json.dumps(["x"] * (MAX_CHOICES + 1))), "limit"),
])
def test_the_door_check_reads_every_kind(spec: StructuredOutput, problem: str) -> None:
    with pytest.raises(InvalidParameter, match=problem) as info:
        check_spec(spec, "guided_x", "guided_x")
    assert info.value.param == "guided_x"
    check_spec(StructuredOutput("choice", json.dumps(CHOICES)), "guided_choice", "guided_choice")  # a good one passes


def test_every_kind_round_trips_through_messages() -> None:
    from kvseal.messages.convert import params_from_msg, params_to_msg

    for spec in (StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(regex=REGEX),
                 StructuredOutputsParams(grammar=GRAMMAR)):
        params = SamplingParams(structured_outputs=spec)
        assert params_from_msg(params_to_msg(params)).structured == params.structured


def allowed_first_tokens(pool: GrammarCompilerPool, spec: StructuredOutput) -> set[int]:
    import xgrammar

    mask = xgrammar.allocate_token_bitmask(1, 128)
    xgrammar.GrammarMatcher(pool.compile_now("alice", spec)).fill_next_token_bitmask(mask, 0)
    return {i for i in range(128) if (int(mask[0, i // 32]) >> (i % 32)) & 1}


def test_no_grammar_allows_a_special_token(char_llm: LLM) -> None:
    """`<s>` (BOS, id 2) is written "<s>": xgrammar, left to read the vocabulary itself, let a
    grammar for "<" [a-z] ">" start with it, and the answer came back empty (special tokens are
    dropped from the text). Special tokens are never a grammar's text; EOS still ends one."""
    pool = GrammarCompilerPool(char_llm.get_tokenizer(), 128, (1,), GrammarConfig(num_workers=1))
    try:
        lt = 3 + 1 + ord("<") - 32  # the char model's id of "<"
        assert allowed_first_tokens(pool, StructuredOutput("regex", "<[a-z]>")) == {lt}
        any_string = allowed_first_tokens(pool, StructuredOutput("json_schema", '{"type": "string"}'))
        assert any_string == {3 + 1 + ord('"') - 32}
    finally:
        pool.close()
    out = char_llm.generate("x", SamplingParams(max_tokens=10, temperature=0,
                                                structured=StructuredOutput("regex", "<[a-z]>")))[0]
    assert re.fullmatch("<[a-z]>", out.text) and out.finish_reason.value == "stop"


# ---- a thinking model's grammar waits for the end of its reasoning block ------------------------

NO_EOS = {1: -100.0}  # the char model's EOS: never sampled while nothing else is allowed


def split_at_end_think(text: str) -> tuple[str, str]:
    reasoning, marker, answer = text.partition("</think>")
    assert marker, f"the reasoning block never ended: {text!r}"
    return reasoning, answer


@pytest.mark.parametrize("open_at_start", [True, False])
def test_a_gated_grammar_constrains_only_the_answer_after_the_reasoning(char_llm: LLM, open_at_start: bool) -> None:
    """The block (open from the prompt, or opened by the first token) is sampled unmasked; the
    regex holds from the token after `</think>`. Without the gate the regex would hold from the
    first token and no `</think>` could be written. Where the prompt opened no block, the first
    token may open one or begin the answer (the seeds here do both)."""
    gate = ReasoningGate(THINK, END_THINK, open_at_start)
    bias = NO_EOS | {THINK: 3.0, END_THINK: 3.0}
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=seed, logit_bias=bias,
                             structured=StructuredOutput("regex", "[a-z]{2}", reasoning=gate)) for seed in range(6)]
    outputs = char_llm.generate(["a", "b", "c", "d", "e", "f"], params)
    reasonings = []
    for out in outputs:
        assert out.finish_reason.value == "stop", out.text
        if not open_at_start and out.token_ids[0] != THINK:
            assert re.fullmatch("[a-z]{2}", out.text), out.text
            continue
        reasoning, answer = split_at_end_think(out.text)
        assert re.fullmatch("[a-z]{2}", answer), out.text
        reasonings.append(reasoning.removeprefix("<think>") if not open_at_start else reasoning)
    assert len(reasonings) >= 2, "too few of the seeds opened a block"
    assert any(re.search("[^a-z]", r) for r in reasonings), f"the reasoning was masked: {reasonings}"
    char_llm.engine.check_integrity()


def test_a_gated_grammar_holds_from_the_first_token_when_no_block_opens(char_llm: LLM) -> None:
    gate = ReasoningGate(THINK, END_THINK, open_at_start=False)
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=0, logit_bias={THINK: -100.0},
                            structured=StructuredOutput("regex", "[a-z]{2}", reasoning=gate))
    outs = char_llm.generate(["a", "b"], [params, dataclasses.replace(params, seed=1)])
    assert all(re.fullmatch("[a-z]{2}", out.text) and out.finish_reason.value == "stop" for out in outs)


def test_the_gate_masks_by_phase(char_llm: LLM) -> None:
    """Opening: the grammar's first tokens and `<think>`; reasoning: no mask at all (not
    constraining, so the row is skipped); answer: the grammar's, `</think>` no longer allowed."""
    import xgrammar

    from kvseal.structured.matching import new_matcher

    pool = GrammarCompilerPool(char_llm.get_tokenizer(), 128, (1,), GrammarConfig(num_workers=1))
    try:
        compiled = pool.compile_now("alice", StructuredOutput("regex", "[a-z]{2}"))
    finally:
        pool.close()
    letters = {3 + 1 + c - 32 for c in range(ord("a"), ord("z") + 1)}

    def allowed(grammar: Any) -> set[int]:
        mask = xgrammar.allocate_token_bitmask(1, 128)
        grammar.fill_next_token_bitmask(mask, 0)
        return {i for i in range(128) if (int(mask[0, i // 32]) >> (i % 32)) & 1}

    grammar = new_matcher(compiled, ReasoningGate(THINK, END_THINK, open_at_start=False))
    assert grammar.constrains and allowed(grammar) == letters | {THINK}
    assert grammar.accept_token(THINK) and not grammar.constrains
    assert grammar.accept_token(3) and grammar.accept_token(THINK) and not grammar.constrains, "anything goes"
    assert grammar.accept_token(END_THINK) and grammar.constrains and allowed(grammar) == letters
    assert not grammar.accept_token(END_THINK), "after the block the grammar decides"
    late = new_matcher(compiled, ReasoningGate(THINK, END_THINK, open_at_start=True))
    assert not late.constrains and not late.is_terminated()
    bit31 = new_matcher(compiled, ReasoningGate(31, END_THINK, open_at_start=False))  # the int32 sign bit
    assert allowed(bit31) == letters | {31}


def test_a_gate_round_trips_and_is_checked_against_the_vocabulary(char_llm: LLM) -> None:
    from kvseal.messages.convert import params_from_msg, params_to_msg

    spec = StructuredOutput("json_object", reasoning=ReasoningGate(THINK, END_THINK, True))
    params = SamplingParams(structured=spec)
    assert params_from_msg(params_to_msg(params)) == params
    with pytest.raises(InvalidParameter, match="reasoning"):
        ReasoningGate(THINK, THINK, False)
    outside = StructuredOutput("json_object", reasoning=ReasoningGate(THINK, 128, True))
    with pytest.raises(InvalidParameter, match="token id 128, outside the vocabulary") as info:
        char_llm.generate("x", SamplingParams(max_tokens=4, structured=outside))
    assert info.value.param == "reasoning"


def test_a_grammar_and_allowed_token_ids_sharing_no_token_end_without_one(char_llm: LLM) -> None:
    """allowed_token_ids and a grammar whose first step shares nothing with them: the request ends
    with no token (never one outside either), a typed error saying why; its batch neighbour runs on."""
    sp = SamplingParams(max_tokens=10, temperature=0, allowed_token_ids=[5],
                        structured_outputs=StructuredOutputsParams(choice=["yes"]))
    free = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    out, neighbour = char_llm.generate(["Say:", "x"], [sp, free])
    assert (out.token_ids, out.finish_reason.value, out.error_code) == ([], "abort", NO_TOKEN_SATISFIES_CONSTRAINTS)
    assert "allowed_token_ids" in (out.error or "") and "grammar" in (out.error or "")
    assert len(neighbour.token_ids) == 5 and neighbour.error is None
    char_llm.engine.check_integrity()
    assert char_llm.engine.stats().num_pages_used == 0


def test_allowed_token_ids_that_run_out_midway_end_the_request_there(char_llm: LLM) -> None:
    """The sets can part at any step: "yes" with only "y" and "e" allowed samples those two,
    then ends at "s" with the typed error, never sampling a token outside either set."""
    tokenizer = char_llm.get_tokenizer()
    y, e = (tokenizer.encode(c, add_special_tokens=False)[0] for c in "ye")
    sp = SamplingParams(max_tokens=10, temperature=0.8, seed=3, allowed_token_ids=[y, e],
                        structured_outputs=StructuredOutputsParams(choice=["yes"]))
    out = char_llm.generate("Say:", sp)[0]
    assert (out.token_ids, out.finish_reason.value, out.error_code) == ([y, e], "abort",
                                                                        NO_TOKEN_SATISFIES_CONSTRAINTS)
    char_llm.engine.check_integrity()
