"""The canary run's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvseal.errors import ConfigError

MIN_TENANTS = 2


@dataclass(frozen=True)
class CanaryConfig:
    base_url: str
    keys: tuple[str, ...]
    model: str | None = None
    num_requests: int = 2000
    concurrency: int = 16
    oversized_fraction: float = 0.05
    abort_fraction: float = 0.05
    # Shares of the answered requests (not oversized) sent with `n` in 2..3 and with logprobs
    # (top alternatives included): response paths a leak could take besides the first choice's text.
    n_fraction: float = 0.1
    logprobs_fraction: float = 0.1
    # vLLM's extensions that return the request's own prompt: `prompt_logprobs` (on a share of
    # the answered requests not streamed: no server streams them) and `echo` (completions: the
    # prompt before the text; chat: an assistant message the answer continues, echoed first).
    prompt_logprobs_fraction: float = 0.05
    echo_fraction: float = 0.05
    # A share of the answered chat requests sent with one function tool and `tool_choice` naming
    # it, whose parameters hold the request's marker (plan.record_code_tool): the tool-call
    # parser's and the forced-call grammar's per-request state. Dropped where the server refuses
    # tools (probes.tools_refusal).
    tools_fraction: float = 0.1
    # The pressure phase, after the run: this many long generations sent at once, so a server
    # whose KV pool cannot hold them all must preempt (take pages from a running request and
    # give them back later). 0: no pressure phase.
    pressure_requests: int = 0
    pressure_max_tokens: int | None = None  # None: as many as the context limit allows
    max_context: int | None = None  # None: read `max_model_len` from /v1/models
    seed: int = 0
    max_tokens: int = 32
    admin_key: str | None = None
    timeout_s: float = 300.0
    drain_timeout_s: float = 30.0
    report_path: str | None = None

    def __post_init__(self) -> None:
        if len(self.keys) < MIN_TENANTS:
            raise ConfigError(f"the canary needs at least {MIN_TENANTS} tenant keys (8 or more recommended), "
                              f"got {len(self.keys)}")
        if len(set(self.keys)) != len(self.keys):
            raise ConfigError("the keys file lists the same key twice; give one distinct key per tenant")
        _require(self.num_requests >= 1, f"--requests must be >= 1, got {self.num_requests}")
        _require(self.concurrency >= 1, f"--concurrency must be >= 1, got {self.concurrency}")
        for name, value in (("--oversized-fraction", self.oversized_fraction),
                            ("--abort-fraction", self.abort_fraction)):
            _require(0.0 <= value <= 1.0, f"{name} must be in [0, 1], got {value}")
        _require(self.oversized_fraction + self.abort_fraction <= 1.0,
                 "--oversized-fraction + --abort-fraction must be <= 1")
        for name, value in (("--n-fraction", self.n_fraction), ("--logprobs-fraction", self.logprobs_fraction),
                            ("--prompt-logprobs-fraction", self.prompt_logprobs_fraction),
                            ("--echo-fraction", self.echo_fraction), ("--tools-fraction", self.tools_fraction)):
            _require(0.0 <= value <= 1.0, f"{name} must be in [0, 1], got {value}")
        _require(self.pressure_requests >= 0, f"--pressure-requests must be >= 0, got {self.pressure_requests}")
        _require(self.pressure_max_tokens is None or self.pressure_max_tokens >= 1,
                 f"--pressure-max-tokens must be >= 1, got {self.pressure_max_tokens}")
        _require(self.max_context is None or self.max_context >= 1,
                 f"--max-context must be >= 1, got {self.max_context}")
        _require(self.max_tokens >= 1, f"--max-tokens must be >= 1, got {self.max_tokens}")
        _require(self.timeout_s > 0, f"--timeout must be > 0, got {self.timeout_s}")
        _require(self.drain_timeout_s >= 0, f"--drain-timeout must be >= 0, got {self.drain_timeout_s}")
        _require(self.base_url.startswith(("http://", "https://")),
                 f"--base-url must start with http:// or https://, got {self.base_url!r}")

    @property
    def num_tenants(self) -> int:
        return len(self.keys)

    @property
    def root_url(self) -> str:
        """The server root: --base-url without a trailing '/v1' (both spellings are accepted)."""
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def load_keys(path: str) -> tuple[str, ...]:
    """The keys file: a JSON list of API keys, one per tenant."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the canary keys file {path}: {exc}") from exc
    if not isinstance(raw, list) or not all(isinstance(k, str) and k.strip() for k in raw):
        raise ConfigError(f'{path} must be a JSON list of non-empty API key strings, one per tenant: ["KEY1", "KEY2"]')
    return tuple(k.strip() for k in raw)
