"""The workload plan: the mix asked for, prompts that fit or overflow by construction."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvseal.canary.config import CanaryConfig, load_keys
from kvseal.canary.plan import FILLER_WORDS, TOOL_CALL_MAX_TOKENS, TOOL_NAME, Endpoint, build_plan, max_prompt_chars
from kvseal.canary.runner import request_body
from kvseal.errors import ConfigError

KEYS = tuple(f"k{i}" for i in range(8))


def _config(**kw: object) -> CanaryConfig:
    return CanaryConfig(base_url="http://127.0.0.1:1", keys=KEYS, **kw)  # type: ignore[arg-type]


def test_plan_has_the_requested_mix() -> None:
    plan = build_plan(_config(num_requests=400, oversized_fraction=0.1, abort_fraction=0.05), max_context=512)
    assert len(plan) == 400
    assert sum(r.is_oversized for r in plan) == 40
    aborts = [r for r in plan if r.abort_after_chunks is not None]
    assert len(aborts) == 20 and all(r.is_stream and not r.is_oversized for r in aborts)
    assert {r.tenant for r in plan} == {f"tenant-{i}" for i in range(8)}
    assert {(r.endpoint, r.is_stream) for r in plan} == {(e, s) for e in Endpoint for s in (True, False)}
    assert len({r.marker.code for r in plan}) == 400


def test_prompts_fit_or_overflow_by_construction() -> None:
    plan = build_plan(_config(num_requests=200, oversized_fraction=0.2, max_tokens=16), max_context=300)
    for r in plan:
        assert r.prompt.startswith(r.marker.text), "the marker opens the prompt (first KV page)"
        if r.is_oversized:
            assert len(r.prompt.split()) > 300  # every word is at least one token
        else:
            assert len(r.prompt) + r.max_tokens <= 300  # never more tokens than characters


def test_plan_is_reproducible_from_the_seed() -> None:
    assert build_plan(_config(seed=5), 512) == build_plan(_config(seed=5), 512)
    assert build_plan(_config(seed=5), 512) != build_plan(_config(seed=6), 512)


def test_refuses_a_context_too_small_for_a_prompt() -> None:
    with pytest.raises(ConfigError, match="context limit 64"):
        build_plan(_config(), max_context=64)
    assert max_prompt_chars() + 32 > 64


@pytest.mark.parametrize(("kw", "message"), [
    ({"keys": ("only-one",)}, "at least 2"),
    ({"keys": ("a", "a")}, "same key twice"),
    ({"num_requests": 0}, "--requests"),
    ({"oversized_fraction": 0.7, "abort_fraction": 0.5}, "must be <= 1"),
    ({"base_url": "127.0.0.1:8000"}, "http://"),
    ({"n_fraction": 1.5}, r"--n-fraction must be in \[0, 1\], got 1.5"),
    ({"logprobs_fraction": -0.1}, "--logprobs-fraction must be in"),
    ({"prompt_logprobs_fraction": 2.0}, "--prompt-logprobs-fraction must be in"),
    ({"echo_fraction": -1.0}, "--echo-fraction must be in"),
    ({"tools_fraction": 1.5}, "--tools-fraction must be in"),
    ({"pressure_requests": -1}, "--pressure-requests must be >= 0"),
    ({"pressure_max_tokens": 0}, "--pressure-max-tokens must be >= 1"),
])
def test_bad_configuration_is_refused(kw: dict[str, object], message: str) -> None:
    args = {"base_url": "http://127.0.0.1:1", "keys": KEYS} | kw
    with pytest.raises(ConfigError, match=message):
        CanaryConfig(**args)  # type: ignore[arg-type]


def test_keys_file_must_be_a_list_of_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "keys.json"
    path.write_text('{"k": {"tenant": "a"}}')
    with pytest.raises(ConfigError, match="JSON list"):
        load_keys(str(path))
    path.write_text('["a", "b"]')
    assert load_keys(str(path)) == ("a", "b")


def test_choices_and_logprobs_go_to_a_seeded_share_of_answered_requests() -> None:
    plan = build_plan(_config(num_requests=400, oversized_fraction=0.1, n_fraction=0.2, logprobs_fraction=0.25),
                      max_context=512)
    answered = [r for r in plan if not r.is_oversized]
    assert sum(r.n > 1 for r in plan) == round(len(answered) * 0.2)
    assert sum(r.logprobs is not None for r in plan) == round(len(answered) * 0.25)
    assert all(r.n == 1 and r.logprobs is None for r in plan if r.is_oversized)
    assert {r.n for r in plan} == {1, 2, 3} and {r.logprobs for r in plan} - {None} == {1, 2, 3, 4, 5}
    # Both endpoints, streaming and not, get each path.
    assert {(r.endpoint, r.is_stream) for r in plan if r.n > 1} == {(e, s) for e in Endpoint for s in (True, False)}
    assert {(r.endpoint, r.is_stream) for r in plan if r.logprobs} == {(e, s) for e in Endpoint for s in (True, False)}


def test_without_the_new_paths_the_plan_is_the_one_the_seed_always_gave() -> None:
    """n and logprobs are drawn from their own stream, prompt_logprobs and echo from another:
    switching them on changes nothing else, and the prompt paths move neither n nor logprobs."""
    off = {"n_fraction": 0.0, "logprobs_fraction": 0.0, "prompt_logprobs_fraction": 0.0, "echo_fraction": 0.0,
           "tools_fraction": 0.0}
    plain = build_plan(_config(seed=9, **off), 512)
    assert all(r.n == 1 and r.logprobs is None and r.prompt_logprobs is None and not r.is_echo
               and not r.is_tool_call for r in plain)
    mixed = build_plan(_config(seed=9), 512)
    assert [replace(r, n=1, logprobs=None, prompt_logprobs=None, is_echo=False, is_tool_call=False, max_tokens=32)
            for r in mixed] == plain
    no_prompt_paths = build_plan(_config(seed=9, prompt_logprobs_fraction=0.0, echo_fraction=0.0), 512)
    assert [replace(r, prompt_logprobs=None, is_echo=False) for r in mixed] == no_prompt_paths
    no_tools = build_plan(_config(seed=9, tools_fraction=0.0), 512)
    assert [replace(r, is_tool_call=False, max_tokens=32) for r in mixed] == no_tools


def test_prompt_logprobs_and_echo_go_to_a_seeded_share_of_answered_requests() -> None:
    """prompt_logprobs only where not streamed (no server streams them); echo on both endpoints,
    streaming and not."""
    plan = build_plan(_config(num_requests=400, oversized_fraction=0.1, prompt_logprobs_fraction=0.2,
                              echo_fraction=0.25), max_context=512)
    answered = [r for r in plan if not r.is_oversized]
    unary = [r for r in answered if not r.is_stream]
    assert sum(r.prompt_logprobs is not None for r in plan) == round(len(unary) * 0.2)
    assert sum(r.is_echo for r in plan) == round(len(answered) * 0.25)
    assert all(r.prompt_logprobs is None and not r.is_echo for r in plan if r.is_oversized)
    assert all(not r.is_stream for r in plan if r.prompt_logprobs is not None)
    assert {r.prompt_logprobs for r in plan} - {None} == {1, 2, 3, 4, 5}
    assert {r.endpoint for r in plan if r.prompt_logprobs} == set(Endpoint)
    assert {(r.endpoint, r.is_stream) for r in plan if r.is_echo} == {(e, s) for e in Endpoint for s in (True, False)}


def test_tool_calls_go_to_a_seeded_share_of_answered_chat_requests() -> None:
    """Chat only, never oversized, a planned abort or pressure; streamed and not, beside the
    other paths; with the tokens a whole call needs."""
    plan = build_plan(_config(num_requests=400, oversized_fraction=0.1, abort_fraction=0.1, tools_fraction=0.3,
                              pressure_requests=4), max_context=512)
    eligible = [r for r in plan if r.endpoint is Endpoint.CHAT and not r.is_oversized
                and r.abort_after_chunks is None and not r.is_pressure]
    tools = [r for r in plan if r.is_tool_call]
    assert len(tools) == round(len(eligible) * 0.3) and all(r in eligible for r in tools)
    assert {r.is_stream for r in tools} == {True, False}
    assert any(r.n > 1 for r in tools) and any(r.logprobs for r in tools) and any(r.is_echo for r in tools)
    assert all(r.max_tokens == TOOL_CALL_MAX_TOKENS for r in tools)
    # where the context leaves fewer tokens, a tool request gets what it leaves
    small = build_plan(_config(num_requests=40, tools_fraction=1.0, max_tokens=8), max_context=max_prompt_chars() + 50)
    assert {r.max_tokens for r in small if r.is_tool_call} == {50}


def test_a_tool_request_offers_one_tool_holding_its_marker_and_forces_a_call_to_it() -> None:
    plan = build_plan(_config(num_requests=40, tools_fraction=1.0), max_context=512)
    request = next(r for r in plan if r.is_tool_call)
    body = request_body(request, "m")
    [tool] = body["tools"]
    assert tool["function"]["name"] == TOOL_NAME == body["tool_choice"]["function"]["name"]
    assert tool["function"]["parameters"]["properties"]["code"]["const"] == request.marker.text
    assert body["tool_choice"]["type"] == "function" and body["max_tokens"] == TOOL_CALL_MAX_TOKENS
    assert all("tools" not in request_body(r, "m") for r in plan if not r.is_tool_call)


def test_pressure_requests_come_last_and_generate_what_the_context_leaves() -> None:
    plan = build_plan(_config(num_requests=20, pressure_requests=6), max_context=512)
    assert [r.is_pressure for r in plan] == [False] * 20 + [True] * 6
    assert all(r.max_tokens == 512 - max_prompt_chars() and not r.is_oversized for r in plan[20:])
    # The run before them is the plan without a pressure phase (up to which requests get n, logprobs,
    # prompt_logprobs and echo).
    def plain(requests: list) -> list:  # type: ignore[type-arg]
        return [replace(r, n=1, logprobs=None, prompt_logprobs=None, is_echo=False) for r in requests]
    assert plain(build_plan(_config(num_requests=20), 512)) == plain(plan[:20])
    capped = build_plan(_config(num_requests=4, pressure_requests=2, pressure_max_tokens=100), 512)
    assert [r.max_tokens for r in capped[4:]] == [100, 100]
    with pytest.raises(ConfigError, match="--pressure-max-tokens 500 does not fit"):
        build_plan(_config(pressure_requests=2, pressure_max_tokens=500), 512)


def test_pressure_prompts_are_as_long_as_a_normal_prompt_may_be() -> None:
    plan = build_plan(_config(num_requests=1, pressure_requests=50), max_context=512)
    longest_word = max(len(w) for w in FILLER_WORDS)
    assert all(max_prompt_chars() - longest_word - 1 < len(r.prompt) <= max_prompt_chars() for r in plan[1:])
