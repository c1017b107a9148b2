"""The workload plan: every request of a run, decided up front from the seed.

Each request belongs to one tenant and carries its own marker. Its prompt puts the marker at
the very start (so it sits in the request's first KV page) and ends with the marker repeated,
which any language model continues: a server that serves stale or foreign KV gives the model
every reason to repeat another request's marker. A fraction of requests is oversized (more
words than the context limit: every tokenizer makes at least one token of a space-separated
word), a fraction of streams is dropped mid-way, and the rest mix both endpoints, streaming
and not. A fraction of the answered requests asks for `n` in 2..3 choices, and a fraction for
logprobs with top alternatives: each choice and each token string is a path a leak could take
besides the first choice's text. A fraction asks for vLLM's `prompt_logprobs` (not streamed:
no server streams them) and a fraction for `echo`, both of which return the request's own
prompt: a server that returns another request's prompt there leaks. A chat request with echo
ends in an assistant message (its marker once more) that the model continues
(`continue_final_message`), since chat echoes only a last message of the answer's own role.
A fraction of the answered chat requests offers one function tool, `record_code`, and names it
in `tool_choice`, so the server's grammar forces a call and its tool-call parser reads it; the
tool's `code` parameter is held to the request's marker (`const`), so every call's arguments
carry it whatever the model, and a call with another request's marker took it from another
request's parser, stream or grammar state.
These are drawn from their own seeded streams, so a plan without them is the plan an older
canary built from the same seed.

The pressure phase (optional) comes after: long generations sent all at once, so a server whose
KV pool cannot hold them all must preempt running requests (take their pages, give them back
later), the path of the incident class behind kvseal's checks.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, replace
from typing import Any

from kvseal.canary.config import CanaryConfig
from kvseal.canary.markers import Marker, MarkerFactory
from kvseal.errors import ConfigError

FILLER_WORDS = ("the", "river", "quiet", "garden", "over", "morning", "paper", "a", "bridge", "under", "simple",
                "window", "blue", "open", "story", "across", "little", "table", "warm", "evening")
MAX_FILLER_WORDS = 12
REPEATS = 3
OVERSIZE_MARGIN_WORDS = 64
CHOICES = (2, 3)  # `n` of a request that asks for several choices
MAX_TOP_LOGPROBS = 5  # completions' legacy limit (OpenAI's); chat's `top_logprobs` takes it too
# A pressure request's default max_tokens where the context allows more: long enough to grow past
# its first pages, short enough for the phase to end well inside --timeout on a real model.
DEFAULT_PRESSURE_TOKENS = 1024
TOOL_NAME = "record_code"
# A tool request's least max_tokens: its whole forced call in any parser's format (hermes'
# `<tool_call>` block is under 90 characters with the marker), at most one token a character.
TOOL_CALL_MAX_TOKENS = 128


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return "/v1/completions" if self is Endpoint.COMPLETIONS else "/v1/chat/completions"


@dataclass(frozen=True)
class PlannedRequest:
    request_id: str  # the canary's own id ("c000042"); the server's id is recorded separately
    tenant: str
    key_index: int
    endpoint: Endpoint
    is_stream: bool
    is_oversized: bool
    abort_after_chunks: int | None  # drop the stream after this many content chunks
    marker: Marker
    prompt: str
    max_tokens: int
    n: int = 1
    logprobs: int | None = None  # top alternatives per position; None: no logprobs asked
    prompt_logprobs: int | None = None  # top alternatives per prompt position; None: not asked
    is_echo: bool = False  # the answer repeats the prompt (completions) or the last message (chat) first
    is_pressure: bool = False  # sent in the pressure phase, all at once
    is_tool_call: bool = False  # chat: offers `record_code_tool` and forces a call to it


def tenant_name(key_index: int) -> str:
    return f"tenant-{key_index}"


def echo_prefill(marker: Marker) -> str:
    """The assistant message a chat request with echo ends in: the answer starts with it."""
    return marker.text + " "


def record_code_tool(code_text: str) -> dict[str, Any]:
    """The one function a tool request offers: its `code` is held to `code_text` (the request's
    marker), so the forced call's grammar writes it into the arguments."""
    code = {"type": "string", "const": code_text, "description": "the user's code"}
    return {"type": "function", "function": {"name": TOOL_NAME, "description": "Record the user's code.",
                                             "parameters": {"type": "object", "properties": {"code": code},
                                                            "required": ["code"]}}}


def prompt_for(marker: Marker, filler: list[str]) -> str:
    body = f"{marker.text} is my code. {' '.join(filler)}. Repeat my code: "
    return body + (marker.text + " ") * REPEATS


def max_prompt_chars() -> int:
    """An upper bound on a normal prompt's length in characters (and so in tokens)."""
    longest = max(len(w) for w in FILLER_WORDS)
    return len(prompt_for(Marker("X" * 12, "", ""), ["x" * longest] * MAX_FILLER_WORDS))


def build_plan(config: CanaryConfig, max_context: int) -> list[PlannedRequest]:
    """The run's requests in send order. Refuses a context too small for a normal prompt."""
    need = max_prompt_chars() + config.max_tokens
    if need > max_context:
        raise ConfigError(f"the server's context limit {max_context} is below what a canary prompt needs "
                          f"({need} tokens with --max-tokens {config.max_tokens}); lower --max-tokens or check "
                          f"--max-context")
    pressure_tokens = pressure_max_tokens(config, max_context)
    rng = random.Random(config.seed)
    markers = MarkerFactory(rng)
    kinds = _kinds(config, rng) + ["pressure"] * config.pressure_requests
    plan = [_request(i, kind, config, max_context, rng, markers) for i, kind in enumerate(kinds)]
    plan = [replace(r, max_tokens=pressure_tokens) if r.is_pressure else r for r in plan]
    return _with_tool_calls(_with_prompt_paths(_with_paths(plan, config), config), config, max_context)


def pressure_max_tokens(config: CanaryConfig, max_context: int) -> int:
    """A pressure request's max_tokens: the flag, or the context a prompt leaves (at most
    DEFAULT_PRESSURE_TOKENS)."""
    room = max_context - max_prompt_chars()
    if config.pressure_max_tokens is None:
        return min(room, DEFAULT_PRESSURE_TOKENS)
    if config.pressure_requests and config.pressure_max_tokens > room:
        raise ConfigError(f"--pressure-max-tokens {config.pressure_max_tokens} does not fit the server's context "
                          f"limit {max_context} beside a canary prompt; at most {room}")
    return config.pressure_max_tokens


def _with_paths(plan: list[PlannedRequest], config: CanaryConfig) -> list[PlannedRequest]:
    """A seeded share of the answered requests gets `n` > 1, another logprobs (exact counts)."""
    rng = random.Random(f"{config.seed}:paths")  # its own stream: the rest of the plan does not move
    eligible = [i for i, r in enumerate(plan) if not r.is_oversized]
    with_n = set(rng.sample(eligible, round(len(eligible) * config.n_fraction)))
    with_logprobs = set(rng.sample(eligible, round(len(eligible) * config.logprobs_fraction)))
    return [replace(r, n=rng.choice(CHOICES) if i in with_n else 1,
                    logprobs=rng.randint(1, MAX_TOP_LOGPROBS) if i in with_logprobs else None)
            for i, r in enumerate(plan)]


def _with_prompt_paths(plan: list[PlannedRequest], config: CanaryConfig) -> list[PlannedRequest]:
    """A seeded share of the answered requests not streamed gets prompt_logprobs, a share of all
    answered ones echo (exact counts)."""
    rng = random.Random(f"{config.seed}:prompt-paths")  # its own stream again: older plans do not move
    eligible = [i for i, r in enumerate(plan) if not r.is_oversized]
    unary = [i for i in eligible if not plan[i].is_stream]
    with_prompt_logprobs = set(rng.sample(unary, round(len(unary) * config.prompt_logprobs_fraction)))
    with_echo = set(rng.sample(eligible, round(len(eligible) * config.echo_fraction)))
    return [replace(r, prompt_logprobs=rng.randint(1, MAX_TOP_LOGPROBS) if i in with_prompt_logprobs else None,
                    is_echo=i in with_echo)
            for i, r in enumerate(plan)]


def _with_tool_calls(plan: list[PlannedRequest], config: CanaryConfig, max_context: int) -> list[PlannedRequest]:
    """A seeded share of the answered chat requests (not planned aborts, which count content
    chunks, nor pressure) forces a call to `record_code` (exact count), with the tokens its call
    needs where the context leaves them (a cut call is no call: the report counts those with one)."""
    tool_tokens = min(max(config.max_tokens, TOOL_CALL_MAX_TOKENS), max_context - max_prompt_chars())
    rng = random.Random(f"{config.seed}:tools")  # its own stream: older plans do not move
    eligible = [i for i, r in enumerate(plan) if r.endpoint is Endpoint.CHAT and not r.is_oversized
                and r.abort_after_chunks is None and not r.is_pressure]
    chosen = set(rng.sample(eligible, round(len(eligible) * config.tools_fraction)))
    return [replace(r, is_tool_call=True, max_tokens=tool_tokens) if i in chosen else r for i, r in enumerate(plan)]


def _kinds(config: CanaryConfig, rng: random.Random) -> list[str]:
    num_oversized = round(config.num_requests * config.oversized_fraction)
    num_aborted = round(config.num_requests * config.abort_fraction)
    kinds = ["oversized"] * num_oversized + ["abort"] * num_aborted
    kinds += ["normal"] * (config.num_requests - len(kinds))
    rng.shuffle(kinds)
    return kinds


def _request(index: int, kind: str, config: CanaryConfig, max_context: int, rng: random.Random,
             markers: MarkerFactory) -> PlannedRequest:
    key_index = index % config.num_tenants
    request_id = f"c{index:06d}"
    marker = markers.new(request_id, tenant_name(key_index))
    if kind == "oversized":
        words = [rng.choice(FILLER_WORDS) for _ in range(max_context + OVERSIZE_MARGIN_WORDS)]
        prompt = prompt_for(marker, words)
    elif kind == "pressure":  # as long as a normal prompt may be: each holds the most KV before it generates
        words = []
        while len(prompt_for(marker, words)) + max(len(w) for w in FILLER_WORDS) + 1 <= max_prompt_chars():
            words.append(rng.choice(FILLER_WORDS))
        prompt = prompt_for(marker, words)
    else:
        prompt = prompt_for(marker, [rng.choice(FILLER_WORDS) for _ in range(rng.randint(0, MAX_FILLER_WORDS))])
    is_stream = kind == "abort" or rng.random() < 0.5
    abort_after = rng.randint(1, max(1, config.max_tokens // 2)) if kind == "abort" else None
    return PlannedRequest(request_id=request_id, tenant=tenant_name(key_index), key_index=key_index,
                          endpoint=rng.choice(list(Endpoint)), is_stream=is_stream,
                          is_oversized=kind == "oversized", abort_after_chunks=abort_after, marker=marker,
                          prompt=prompt, max_tokens=config.max_tokens, is_pressure=kind == "pressure")
