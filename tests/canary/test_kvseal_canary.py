"""The canary against a real kvseal server: a clean run passes; each fault must fail it.

The model is `copy_model.py`'s hand-built copier, which repeats whatever its context holds
one marker-period back, so a response shows exactly whose KV the request attended to (a
random-weight model would never repeat a marker and the run could not fail). With page size
256 a whole canary request lives in its first KV page, the page FOREIGN_PAGE swaps.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvseal_server import KvsealServer

from kvseal.canary.evidence import PAGES_SCRUBBED, scrape
from kvseal.server import auth

NUM_TENANTS = 8
CANARY_KEYS = [f"canary-key-{i}" for i in range(NUM_TENANTS)]
ADMIN_KEY = "canary-admin-key"
# Until the frontend's admin keys exist, /metrics is open and read without a key.
HAS_ADMIN_KEYS = "admin" in getattr(auth, "_FIELDS", set())
RunCanary = Callable[..., tuple[int, dict[str, Any]]]


def _server_keys() -> dict[str, dict[str, object]]:
    keys: dict[str, dict[str, object]] = {k: {"tenant": f"t{i}"} for i, k in enumerate(CANARY_KEYS)}
    if HAS_ADMIN_KEYS:
        keys[ADMIN_KEY] = {"tenant": "ops", "admin": True}
    return keys


# The fault tests send the plan their seeds always gave (one choice, no logprobs, prompt_logprobs,
# echo or tools: those paths are drawn from their own seeded streams, so nothing else moves): the
# leaks they must catch come from which requests overlap in the pool, and the clean run is where
# the other paths are exercised.
FIRST_CHOICE_ONLY = ["--n-fraction", "0", "--logprobs-fraction", "0", "--prompt-logprobs-fraction", "0",
                     "--echo-fraction", "0", "--tools-fraction", "0"]
# The server parses hermes' tool calls, so the canary's tool requests get forced calls to read.
TOOL_PARSER = ["--tool-call-parser", "hermes"]


def _admin_flags() -> list[str]:
    return ["--admin-key", ADMIN_KEY] if HAS_ADMIN_KEYS else []


# The pressure phase against the tests' pool (8192 tokens in 32 pages of 256): 18 requests whose
# prompts (about 180 tokens) grow by 96 generated tokens past their first page need 36 pages at
# once, more than the pool holds, so the scheduler must preempt some of them.
PRESSURE_FLAGS = ["--pressure-requests", "18", "--pressure-max-tokens", "96"]


def test_clean_server_passes(copy_model_dir: Path, tmp_path: Path, run_canary: RunCanary) -> None:
    """(d) 8 tenants x 25 requests, checks and scrub off, a tenth of them with n = 2..3, a tenth
    with logprobs, a twentieth with prompt_logprobs and one with echo (chat: continuing an
    assistant message), a tenth of the chat ones forcing a tool call (hermes), then a pressure
    phase that makes the engine preempt: zero leaks in any choice, token string, token bytes,
    prompt token or call, evidence consistent, the preemptions reported."""
    with KvsealServer(copy_model_dir, tmp_path, _server_keys(), extra_args=TOOL_PARSER) as server:
        status, report = run_canary(server.url, CANARY_KEYS, "--requests", "200", "--max-tokens", "16",
                                    "--seed", "1", *PRESSURE_FLAGS, *_admin_flags())
    assert status == 0, report["verdict"]
    assert report["leaks"] == [] and report["same_tenant_crossings"] == []
    assert report["oversized_prompts"] == {"4xx": 10, "2xx": 0, "5xx": 0, "other": 0}
    outcomes = report["requests_by_outcome"]
    assert outcomes == {"aborted": 10, "ok": 198, "rejected": 10}
    # The run had power: every completed response repeated its own marker (an echo request's
    # answer holds its prompt, a forced call its marker, whatever the model does: not counted).
    echo = report["own_marker_echoes"]
    assert echo["of_completed"] == 198 and echo["echo_requests_not_counted"] > 0, echo
    assert echo["tool_requests_not_counted"] > 0, echo
    assert echo["responses"] == 198 - echo["echo_requests_not_counted"] - echo["tool_requests_not_counted"], echo
    # Every tool request came back with a call to the canary's tool in every choice, and its
    # arguments were read (the parser's path, streamed and not).
    tools = report["paths"]["tool_calls"]
    assert tools["asked"] == tools["completed"] == tools["with_call"] > 0 and tools["not_exercised"] is None, tools
    # Every choice of an n > 1 request came back, and every logprobs request carried tokens and
    # top alternatives: the canary read those paths and found only the request's own marker there.
    several, logprobs = report["paths"]["n_gt_1"], report["paths"]["logprobs"]
    assert several["completed"] == several["with_every_choice"] > 0, several
    assert logprobs["completed"] == logprobs["with_tokens"] == logprobs["with_top_alternatives"] > 0, logprobs
    # kvseal serves vLLM's prompt_logprobs and echo (chat's too): each asked for came back, and was read.
    prompt_logprobs, echoed = report["paths"]["prompt_logprobs"], report["paths"]["echo"]
    assert prompt_logprobs["completed"] == prompt_logprobs["answered"] > 0, prompt_logprobs
    assert echoed["completed"] == echoed["answered"] > 0, echoed
    assert report["preemption"]["pressure_requests"] == 18
    evidence = report["server_evidence"]
    assert evidence["available"], evidence
    assert isinstance(evidence["preemptions"], float) and evidence["preemptions"] > 0, evidence
    assert report["preemption"]["server_reported"] == evidence["preemptions"]
    assert evidence["rejections_by_reason"] == {"context_length_exceeded": 10.0}
    assert sum(evidence["requests_by_outcome"].values()) == 218
    assert evidence["allocator_after_run"]["pages_used"] == 0 and evidence["allocator_after_run"]["is_idle"]
    # The default scrub mode overwrites nothing: the count is 0 by design, and the report says so.
    assert evidence["scrub_mode"] == "off" and evidence["pages_scrubbed"] == 0
    # The tenancy probes ran: a made-up key refused; each key's repeat served from its cache, the next key's not.
    assert report["tenancy"]["open_door"] is None
    pairs = report["tenancy"]["prefix_probe"]["pairs"]
    assert len(pairs) == 4 and all(p["own_repeat"] > 0 and p["other_key"] == 0 for p in pairs), pairs


def test_a_scrubbing_server_reports_the_pages_it_scrubbed(copy_model_dir: Path, tmp_path: Path,
                                                          run_canary: RunCanary) -> None:
    """With --kv-scrub free, /metrics' counter rises over the run and the canary's evidence has
    the number (not "unavailable") beside the mode."""
    admin_key = ADMIN_KEY if HAS_ADMIN_KEYS else None
    with KvsealServer(copy_model_dir, tmp_path, _server_keys(), extra_args=["--kv-scrub", "free"]) as server:
        before = scrape(server.url, admin_key)
        status, report = run_canary(server.url, CANARY_KEYS[:2], "--requests", "16", "--max-tokens", "16",
                                    "--seed", "2", "--tools-fraction", "0.5", *_admin_flags())
        after = scrape(server.url, admin_key)
    assert status == 0, report["verdict"]
    # Started without --tool-call-parser, the server refuses tools: the run leaves its tool
    # requests out and says so, rather than failing on refusals.
    tools = report["paths"]["tool_calls"]
    assert tools["asked"] == 0 and "parses no tool calls" in tools["not_exercised"], tools
    assert report["run"]["tools_not_sent"] == tools["not_exercised"]
    evidence = report["server_evidence"]
    assert evidence["scrub_mode"] == "free"
    scrubbed = evidence["pages_scrubbed"]
    assert isinstance(scrubbed, float) and scrubbed > 0, evidence
    # the evidence counts the marker run; the tenancy probe before it freed (and scrubbed) pages too
    assert before.total(PAGES_SCRUBBED) == 0 and after.total(PAGES_SCRUBBED) > scrubbed


def test_placeholder_fault_fails_the_run(copy_model_dir: Path, tmp_path: Path, run_canary: RunCanary) -> None:
    """(b) The incident's path with the default isolation flags (no --check-kv, no scrub). A token
    budget of 256 splits some prompts into chunks whose later parts are computed for real (as in
    the incident, where only some prompts took the placeholder path), so the pool holds real
    markers that placeholder requests then read. The run must fail: by foreign markers while
    the engine leaks silently, by 500 isolation_check_failed once it checks coverage itself."""
    with KvsealServer(copy_model_dir, tmp_path, _server_keys(), faults=["placeholder_prefill"],
                      extra_args=["--max-num-batched-tokens", "256"]) as server:
        status, report = run_canary(server.url, CANARY_KEYS, "--requests", "64", "--seed", "2", *FIRST_CHOICE_ONLY,
                                    *_admin_flags())
    assert status == 1
    caught_by_engine = [e for e in report["server_errors"] if "isolation_check_failed" in str(e["error"])]
    assert report["leaks"] or caught_by_engine, report["verdict"]
    _assert_leaks_well_formed(report)


def test_foreign_page_without_checks_is_caught_by_markers(copy_model_dir: Path, tmp_path: Path,
                                                          run_canary: RunCanary) -> None:
    """(c) A block table naming another request's page, checks bypassed, scrub off: only the
    canary stands between this and a silent leak, and it must report it by markers. Whether a
    foreign page holds another tenant's marker when it is read depends on which requests overlap,
    so the run is long enough that some do: at 48 requests a faster engine (round 6) caught no
    leak in 1 of 3 runs; at 160, every run saw 14-34 leaks."""
    with KvsealServer(copy_model_dir, tmp_path, _server_keys(), faults=["foreign_page", "bypass_kv_checks"],
                      extra_args=["--kv-scrub", "off"]) as server:
        status, report = run_canary(server.url, CANARY_KEYS, "--requests", "160", "--seed", "3",
                                    *FIRST_CHOICE_ONLY, *_admin_flags())
    assert status == 1
    assert report["leaks"], report["verdict"]
    assert any("foreign markers" in reason for reason in report["verdict"]["reasons"])
    _assert_leaks_well_formed(report)


def test_a_cross_tenant_prefix_hit_is_caught_by_the_probe(copy_model_dir: Path, tmp_path: Path,
                                                           run_canary: RunCanary) -> None:
    """(e) The prefix cache without its tenant namespace, checks bypassed: the same prompt gives
    the same answer, so no marker can show it; the probe sees the other key served from cache."""
    with KvsealServer(copy_model_dir, tmp_path, _server_keys(), faults=["drop_cache_namespace", "bypass_kv_checks"],
                      ) as server:
        status, report = run_canary(server.url, CANARY_KEYS[:2], "--requests", "8", "--max-tokens", "16",
                                    "--seed", "5", *FIRST_CHOICE_ONLY, *_admin_flags())
    assert status == 1
    [pair] = report["tenancy"]["prefix_probe"]["pairs"]
    assert pair["own_repeat"] > 0 and pair["other_key"] > 0, pair
    assert any("key 1 was served" in reason and "leaks across tenants" in reason
               for reason in report["verdict"]["reasons"]), report["verdict"]


def test_a_tool_parser_that_keeps_state_across_requests_is_caught_in_the_calls(
        copy_model_dir: Path, tmp_path: Path, run_canary: RunCanary) -> None:
    """The hermes parser handing each call the arguments of the call it read before (another
    request's): the canary finds foreign markers in the calls' arguments, streamed and not, and
    names those fields. The clean run above is the same path with the fault off, and passes."""
    with KvsealServer(copy_model_dir, tmp_path, _server_keys(), faults=["stale_tool_arguments"],
                      extra_args=TOOL_PARSER) as server:
        status, report = run_canary(server.url, CANARY_KEYS, "--requests", "32", "--max-tokens", "16", "--seed", "6",
                                    *FIRST_CHOICE_ONLY, "--tools-fraction", "1", *_admin_flags())
    assert status == 1
    assert report["leaks"], report["verdict"]
    _assert_leaks_well_formed(report)
    fields = {name for leak in report["leaks"] for name in leak["fields"]}
    assert all(".tool_calls[" in name and name.endswith(".function.arguments") for name in fields), fields
    assert {name.split(".")[1] for name in fields} == {"message", "delta"}, fields  # unary and streamed
    assert any("tool_calls" in reason for reason in report["verdict"]["reasons"]), report["verdict"]
    assert report["server_errors"] == [] and report["unanswered"] == []


def _assert_leaks_well_formed(report: dict[str, Any]) -> None:
    for leak in report["leaks"]:
        assert leak["tenant"] != leak["foreign_tenant"]
        assert leak["request_id"] != leak["foreign_request_id"]
        assert leak["server_request_id"]
        assert len(leak["matched"]) >= 10


def test_clean_pd_server_passes_with_its_engines_pools_in_the_evidence(
        copy_model_dir: Path, tmp_path: Path, run_canary: RunCanary) -> None:
    """`kvseal serve --pd`: the frontend exports the engines' pools (summed over prefill and
    decode), so the server evidence reads a real verdict: every page of both pools free again."""
    with KvsealServer(copy_model_dir, tmp_path, _server_keys(), extra_args=["--pd"]) as server:
        status, report = run_canary(server.url, CANARY_KEYS, "--requests", "40", "--max-tokens", "16",
                                    "--seed", "4", *FIRST_CHOICE_ONLY, *_admin_flags())
    assert status == 0, report["verdict"]
    assert report["leaks"] == [] and report["server_errors"] == []
    evidence = report["server_evidence"]
    assert evidence["available"], evidence
    assert evidence["isolation_violations"] == 0
    assert sum(evidence["requests_by_outcome"].values()) == 40
    alloc = evidence["allocator_after_run"]
    num_pages = 2 * 8192 // 256  # --kv-cache-tokens / --page-size, one pool per engine
    assert alloc == {"pages_used": 0, "pages_free": num_pages, "pages_total": num_pages,
                     "pages_total_before": num_pages, "is_idle": True}, alloc
