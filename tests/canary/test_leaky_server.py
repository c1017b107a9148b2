"""Negative control (a): a server that hands one tenant another tenant's prompt is caught,
with the right request ids and both tenants; the same server without leaks passes, unless it
has no tenants (it takes any key) or refuses some of the canary's requests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from leaky_server import LeakyServer
from processes import free_port

KEYS = [f"leaky-key-{i}" for i in range(4)]
FLAGS = ["--requests", "60", "--concurrency", "4", "--seed", "3"]


def test_leaky_server_is_caught(run_canary: Callable[..., tuple[int, dict[str, Any]]]) -> None:
    with LeakyServer(free_port(), leak_every=7, keys=KEYS) as server:
        # No planned aborts here: a stream dropped before the leaked marker arrives would hide it.
        status, report = run_canary(f"{server.url}/v1", KEYS, *FLAGS, "--abort-fraction", "0")
        truth = dict(server.log.leaks)
    assert status == 1
    assert not report["verdict"]["passed"]
    assert truth, "the leaky server leaked at least once"
    # Every leak the server committed is reported, and nothing else.
    reported = {leak["server_request_id"]: leak for leak in report["leaks"]}
    assert set(reported) == set(truth)
    for server_id, (victim_key, source_key) in truth.items():
        leak = reported[server_id]
        assert leak["tenant"] == f"tenant-{KEYS.index(victim_key)}"
        assert leak["foreign_tenant"] == f"tenant-{KEYS.index(source_key)}"
        assert leak["foreign_request_id"] != leak["request_id"]
        assert leak["is_full"], "lower case and spaces do not hide a whole marker"
    assert any("foreign markers" in reason for reason in report["verdict"]["reasons"])


def test_same_server_without_leaks_passes(run_canary: Callable[..., tuple[int, dict[str, Any]]]) -> None:
    """A server that is not kvseal: no evidence (reported as unavailable, not a failure)."""
    with LeakyServer(free_port(), leak_every=0, keys=KEYS) as server:
        status, report = run_canary(server.url, KEYS, *FLAGS)
    assert status == 0, report["verdict"]
    assert report["leaks"] == []
    assert report["oversized_prompts"]["4xx"] == 3 and report["oversized_prompts"]["2xx"] == 0
    assert report["requests_by_outcome"] == {"aborted": 3, "ok": 54, "rejected": 3}
    assert report["server_evidence"] == {"available": False, "reason": "GET /metrics answered 404"}
    assert report["preemption"] == {"pressure_requests": 0, "server_reported": "unknown",
                                    "why_unknown": "GET /metrics answered 404"}
    assert report["run"]["model"] == "leaky-model" and report["run"]["max_context"] == 2048


def test_a_server_without_tenants_fails_the_run(run_canary: Callable[..., tuple[int, dict[str, Any]]]) -> None:
    """It answers a key it was never given: the keys are not tenants, and zero leaks proves nothing."""
    with LeakyServer(free_port(), leak_every=0, keys=None) as server:
        status, report = run_canary(server.url, KEYS, *FLAGS)
    assert status == 1 and report["leaks"] == []
    assert report["tenancy"]["open_door"] and "never given" in report["tenancy"]["open_door"]
    assert report["verdict"]["reasons"] == [report["tenancy"]["open_door"]]


def test_normal_requests_refused_fail_the_run(run_canary: Callable[..., tuple[int, dict[str, Any]]]) -> None:
    """A key the server does not know: its requests are 401, answers the run never saw."""
    with LeakyServer(free_port(), leak_every=0, keys=KEYS[:3]) as server:
        status, report = run_canary(server.url, KEYS, *FLAGS)
    assert status == 1 and report["refused"]
    assert {row["tenant"] for row in report["refused"]} == {"tenant-3"}
    reasons = report["verdict"]["reasons"]
    assert any("normal requests refused 4xx (invalid_api_key" in reason for reason in reasons), reasons
    assert any("prefix probe's requests were refused" in reason and "key 3: 401" in reason for reason in reasons)


def _is_only_where(leak_in: str, field: str) -> bool:
    """Where else a mode's leak may show: the second choice's own logprobs; a position's top
    alternatives, which hold its chosen token (as OpenAI's and vLLM's do); for echo, any field
    of the first choice (its text, and its tokens where logprobs were asked); for bytes, the
    search in any rank order over each position's bytes, its chosen token's among them. Never
    the first choice's text otherwise."""
    if leak_in == "logprob_bytes":
        return field in LEAK_FIELD_NAMES[leak_in] | {"choices[0].logprobs.content[].top_logprobs[].bytes[any rank]"}
    if leak_in in ("error", "prompt_logprobs", "reasoning", "tool_call"):
        return field in LEAK_FIELD_NAMES[leak_in]
    if leak_in == "second_choice":
        return field.startswith("choices[1].")
    if leak_in == "logprob_token":
        return field.startswith("choices[0].logprobs.")
    if leak_in == "echo":
        return field.startswith("choices[0].")
    return field in LEAK_FIELD_NAMES["top_logprob"]


_RANKED = {"choices[0].logprobs.top_logprobs", "choices[0].logprobs.content[].top_logprobs[].token",
           "choices[0].logprobs.content[].top_logprobs[].bytes"}
_PROMPT_LOGPROBS = {"prompt_logprobs[].decoded_token", "choices[0].prompt_logprobs[].decoded_token"}
# The field each leak mode puts a foreign marker in, as the report names it (by endpoint and stream).
LEAK_FIELD_NAMES = {
    "second_choice": {"choices[1].text", "choices[1].message.content", "choices[1].delta.content"},
    "logprob_token": {"choices[0].logprobs.tokens", "choices[0].logprobs.content[].token"},
    "top_logprob": _RANKED | {f"{name}[any rank]" for name in _RANKED},
    "error": {"error"},
    "logprob_bytes": {"choices[0].logprobs.content[].bytes"},
    "top_logprob_shuffled": {f"{name}[any rank]" for name in _RANKED},
    "prompt_logprobs": _PROMPT_LOGPROBS | {f"{name}[any rank]" for name in _PROMPT_LOGPROBS},
    "echo": {"choices[0].text", "choices[0].message.content", "choices[0].delta.content"},
    "reasoning": {"choices[0].message.reasoning_content", "choices[0].delta.reasoning_content"},
    "tool_call": {"choices[0].message.tool_calls[0].function.arguments",
                  "choices[0].delta.tool_calls[0].function.arguments"},
}
# Modes whose path the default plan takes too rarely in 60 requests to be sure of a leak.
MODE_FLAGS = {"prompt_logprobs": ["--prompt-logprobs-fraction", "0.3"], "echo": ["--echo-fraction", "0.3"]}


@pytest.mark.parametrize("leak_in", sorted(LEAK_FIELD_NAMES))
def test_a_leak_outside_the_first_choices_text_is_caught_and_its_field_named(
        leak_in: str, run_canary: Callable[..., tuple[int, dict[str, Any]]]) -> None:
    """The server leaks only into one path: a second choice, the chosen logprob tokens or their
    bytes, a top alternative (at one rank, or spread over ranks by turns), prompt_logprobs, the
    echoed prompt, reasoning, a tool call's arguments, or an oversized prompt's 400, and only on
    that path: the canary's plan takes each (n > 1, logprobs, prompt_logprobs and echo on a share
    of its requests, oversized prompts; reasoning and tool calls read wherever they appear),
    reads every field, the error's whole body too, and names the one each leak was in. A canary
    that did not ask for a path, or did not read the field (the one before bytes, prompt_logprobs,
    echo, reasoning, tool calls and the search in any rank order passed each of those modes),
    passes its run."""
    with LeakyServer(free_port(), leak_every=0, keys=KEYS, leak_in=leak_in) as server:
        status, report = run_canary(server.url, KEYS, *FLAGS, "--abort-fraction", "0", *MODE_FLAGS.get(leak_in, []))
        truth = dict(server.log.leaks)
    assert truth, f"the plan asked for the {leak_in} path, so the server leaked at least once"
    assert status == 1
    reported = {leak["server_request_id"]: leak for leak in report["leaks"]}
    assert set(reported) == set(truth)
    for server_id, (victim_key, source_key) in truth.items():
        leak = reported[server_id]
        assert (leak["tenant"], leak["foreign_tenant"]) == (f"tenant-{KEYS.index(victim_key)}",
                                                            f"tenant-{KEYS.index(source_key)}")
        assert leak["is_full"] and set(leak["fields"]) & LEAK_FIELD_NAMES[leak_in], leak
        assert all(_is_only_where(leak_in, name) for name in leak["fields"]), leak
    [reason] = [r for r in report["verdict"]["reasons"] if "foreign markers" in r]
    assert "in fields: " in reason and any(f"{name} x" in reason for name in LEAK_FIELD_NAMES[leak_in]), reason
    _assert_the_path_was_checked(leak_in, report["paths"])


def _assert_the_path_was_checked(leak_in: str, paths: dict[str, Any]) -> None:
    """Every request that asked for the path got an answer in it, so the run checked it."""
    if leak_in == "second_choice":
        assert paths["n_gt_1"]["completed"] == paths["n_gt_1"]["with_every_choice"] > 0
    elif leak_in in ("logprob_token", "top_logprob", "logprob_bytes", "top_logprob_shuffled"):
        assert paths["logprobs"]["completed"] == paths["logprobs"]["with_tokens"] > 0
    elif leak_in == "prompt_logprobs":
        assert paths["prompt_logprobs"]["completed"] == paths["prompt_logprobs"]["answered"] > 0
    elif leak_in == "echo":
        assert paths["echo"]["completed"] > 0
    elif leak_in in ("reasoning", "tool_call"):
        assert paths["reasoning_or_tool_calls"] > 0


@pytest.mark.parametrize("leak_in", ["prompt_logprobs", "echo"])
def test_a_path_the_canary_does_not_ask_for_is_not_checked(
        leak_in: str, run_canary: Callable[..., tuple[int, dict[str, Any]]]) -> None:
    """With its share at 0 the canary never asks for the path, the server never leaks into it, and
    the run passes: why the canary asks by default, and why a 0 there is a path left unchecked."""
    off = ["--prompt-logprobs-fraction", "0", "--echo-fraction", "0"]
    with LeakyServer(free_port(), leak_every=0, keys=KEYS, leak_in=leak_in) as server:
        status, report = run_canary(server.url, KEYS, *FLAGS, "--abort-fraction", "0", *off)
        truth = dict(server.log.leaks)
    assert status == 0 and not truth and report["leaks"] == [], report["verdict"]
    assert report["paths"][leak_in]["completed"] == 0
