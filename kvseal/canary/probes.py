"""Checks of the tenancy itself, run before the marker run: markers prove that no response holds
another tenant's text, which says nothing if the keys are not distinct tenants, and cannot see
one tenant being served another's cached prompt (the same prompt gives the same answer).

- The open door: a key the canary made up must be refused (a one-token completion sent with it).
  A server that answers it has no tenants (kvseal without `--api-keys`): there is nothing to
  isolate, and the run fails.
- The prefix probe (I5): for each of the first few pairs of keys, key A sends a prompt no other
  request has, twice, then key B sends it. A's repeat shows the cache at work (its
  `usage.prompt_tokens_details.cached_tokens`); B must get none of it. B served A's cached
  tokens means the two keys are one tenant, or the cache leaks across tenants: the run fails.
  Where A's repeat is not served from cache either (caching off, a server that does not report
  it), the probe says it could not test, and judges nothing.
- Tools (before the run, where the plan has tool requests): one chat request with the canary's
  tool and max_tokens 1. A server that refuses it for its `tools` or `tool_choice` (kvseal
  without --tool-call-parser) parses no tool calls: the run leaves its tool requests out and the
  report says why, rather than failing on refusals that say nothing about isolation.
"""

from __future__ import annotations

import secrets
from typing import Any

import httpx

from kvseal.canary.markers import ALPHABET, MARKER_LEN, display
from kvseal.canary.plan import TOOL_NAME, record_code_tool
from kvseal.canary.runner import Target, error_text

MAX_PROBED_PAIRS = 4  # key pairs (0, 1), (1, 2), ...: a few requests each, before the run
PROBE_PROMPT_CHARS = 600  # several pages of tokens on any tokenizer (ASCII: at most one token a character)
PROBE_HEADROOM_TOKENS = 16  # the template's and the tokenizer's own tokens, and the one generated


def open_door(target: Target) -> str | None:
    """Why the run cannot be evidence when the server answers a key it was never given; None
    when it refuses it."""
    made_up = f"kvseal-canary-{secrets.token_hex(16)}"
    body = {"model": target.model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    try:  # a generation, not /v1/models, which a gateway may leave open while it guards the rest
        resp = httpx.post(f"{target.root_url}/v1/completions", json=body,
                          headers={"authorization": f"Bearer {made_up}"}, timeout=target.timeout_s)
    except httpx.HTTPError:
        return None  # the run itself will say the server cannot be reached
    if resp.status_code == 200:
        return ("the server answered an API key it was never given: it has no tenants to isolate (kvseal: start it "
                "with --api-keys, one key per tenant)")
    return None


def tools_refusal(target: Target) -> str | None:
    """Why the run sends no tool requests: the server refused the canary's tool (a 4xx naming
    `tools` or `tool_choice`); None when it took it, or failed otherwise (the run says how)."""
    code = display("".join(secrets.choice(ALPHABET) for _ in range(MARKER_LEN)))
    body = {"model": target.model, "messages": [{"role": "user", "content": f"My code is {code}."}],
            "max_tokens": 1, "temperature": 0, "tools": [record_code_tool(code)],
            "tool_choice": {"type": "function", "function": {"name": TOOL_NAME}}}
    try:
        resp = httpx.post(f"{target.root_url}/v1/chat/completions", json=body,
                          headers={"authorization": f"Bearer {target.keys[0]}"}, timeout=target.timeout_s)
    except httpx.HTTPError:
        return None  # the run itself will say the server cannot be reached
    if 400 <= resp.status_code < 500 and _error_param(resp) in ("tools", "tool_choice"):
        return (f"the server parses no tool calls (start it with --tool-call-parser; it answered "
                f"{resp.status_code} {error_text(resp.text)})")
    return None


def _error_param(resp: httpx.Response) -> str | None:
    try:
        param = resp.json()["error"]["param"]
    except (ValueError, KeyError, TypeError):
        return None
    return param if isinstance(param, str) else None


def prefix_probe(target: Target, max_context: int) -> dict[str, Any]:
    """The probe's pairs: each one's cached tokens on its own repeat and on the other key."""
    chars = min(PROBE_PROMPT_CHARS, max_context - PROBE_HEADROOM_TOKENS)
    pairs = []
    with httpx.Client(base_url=target.root_url, timeout=target.timeout_s) as client:
        for first in range(min(MAX_PROBED_PAIRS, len(target.keys) - 1)):
            prompt = _probe_prompt(chars)
            own = [_cached_tokens(client, target, first, prompt) for _ in range(2)]
            other = _cached_tokens(client, target, first + 1, prompt)
            pairs.append({"keys": [first, first + 1], "own_repeat": own[1], "other_key": other, "first": own[0]})
    return {"prompt_chars": chars, "pairs": pairs}


def probe_reasons(probe: dict[str, Any]) -> list[str]:
    """Why the probe fails the run: a request it could not make, or another key served from cache."""
    reasons = []
    for pair in probe["pairs"]:
        first, second = pair["keys"]
        failed = [f"key {index}: {answer}" for index, answer in ((first, pair["first"]), (first, pair["own_repeat"]),
                                                                 (second, pair["other_key"]))
                  if isinstance(answer, str)]
        if failed:
            reasons.append(f"the prefix probe's requests were refused or failed ({'; '.join(failed)})")
        elif pair["other_key"] > 0:
            reasons.append(f"key {second} was served {pair['other_key']} cached prompt tokens of a prompt only key "
                           f"{first} had sent: the two keys are one tenant, or the prefix cache leaks across tenants")
    return reasons


def probe_summary(probe: dict[str, Any]) -> str:
    pairs = probe["pairs"]
    if not pairs:
        return "not run (one key)"
    own = [p["own_repeat"] for p in pairs if isinstance(p["own_repeat"], int)]
    other = [p["other_key"] for p in pairs if isinstance(p["other_key"], int)]
    tested = "" if any(own) else " (not tested: no repeat was served from cache)"
    return (f"{len(pairs)} key pairs: cached tokens on a key's own repeat {own}, on the next key {other}{tested}")


def _probe_prompt(num_chars: int) -> str:
    """A prompt no other request has: random words, so it shares no page with anything sent before."""
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < num_chars:
        words.append(secrets.token_hex(4))
    return " ".join(words)[:num_chars]


def _cached_tokens(client: httpx.Client, target: Target, key_index: int, prompt: str) -> int | str:
    """The cached prompt tokens `usage` reports for `prompt` sent with the key (0 when it
    reports none), or what went wrong."""
    body = {"model": target.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    try:
        resp = client.post("/v1/completions", json=body,
                           headers={"authorization": f"Bearer {target.keys[key_index]}"})
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if resp.status_code != 200:
        return f"{resp.status_code} {error_text(resp.text)}"
    try:
        details = resp.json().get("usage", {}).get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        return f"an answer without usage: {resp.text[:200]}"
