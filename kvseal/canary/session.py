"""One canary run end to end: discover the target, plan, probe the tenancy, run, collect
evidence, judge."""

from __future__ import annotations

import asyncio
import datetime
import time
from dataclasses import replace
from typing import Any

import httpx
from tqdm import tqdm

from kvseal.canary.config import CanaryConfig
from kvseal.canary.evidence import evidence, scrape, scrape_after_drain
from kvseal.canary.plan import build_plan
from kvseal.canary.probes import open_door, prefix_probe, tools_refusal
from kvseal.canary.report import analyse, build_report
from kvseal.canary.runner import RequestResult, Target, run_plan
from kvseal.errors import ConfigError


def discover(config: CanaryConfig) -> tuple[str, int]:
    """The model to ask for and the server's context limit (flags win over /v1/models)."""
    if config.model is not None and config.max_context is not None:
        return config.model, config.max_context
    cards = _model_cards(config)
    card = cards[0] if config.model is None else next((c for c in cards if c.get("id") == config.model), None)
    if card is None:
        raise ConfigError(f"/v1/models does not list --model {config.model!r}; it lists "
                          f"{[c.get('id') for c in cards]}")
    max_context = config.max_context or card.get("max_model_len")
    if not isinstance(max_context, int) or max_context < 1:
        raise ConfigError(f"/v1/models does not report max_model_len for {card.get('id')!r}; pass --max-context")
    return str(card["id"]), max_context


def _model_cards(config: CanaryConfig) -> list[dict[str, Any]]:
    url = f"{config.root_url}/v1/models"
    try:
        resp = httpx.get(url, headers={"authorization": f"Bearer {config.keys[0]}"}, timeout=30)
    except httpx.HTTPError as exc:
        raise ConfigError(f"cannot reach {url}: {exc}") from exc
    if resp.status_code != 200:
        raise ConfigError(f"GET {url} answered {resp.status_code}: {resp.text[:200]}")
    cards = resp.json().get("data") or []
    if not cards:
        raise ConfigError(f"GET {url} lists no models; pass --model and --max-context")
    return list(cards)


def run_canary(config: CanaryConfig, show_progress: bool | None = None) -> dict[str, Any]:
    """Run the whole canary and return its report (see `report.build_report`)."""
    model, max_context = discover(config)
    plan = build_plan(config, max_context)
    target = Target(config.root_url, model, config.keys, config.timeout_s)
    tools_not_sent = tools_refusal(target) if any(r.is_tool_call for r in plan) else None
    if tools_not_sent:  # the same plan without its tool requests (they are drawn from their own stream)
        plan = build_plan(replace(config, tools_fraction=0.0), max_context)
    tenancy = {"open_door": open_door(target), "prefix_probe": prefix_probe(target, max_context)}
    before = scrape(config.root_url, config.admin_key)
    started_at = datetime.datetime.now(datetime.UTC)
    started = time.monotonic()
    disable = None if show_progress is None else not show_progress  # None: on when stderr is a terminal
    with tqdm(total=len(plan), desc="canary", unit="req", disable=disable) as bar:
        def on_result(result: RequestResult) -> None:
            bar.update(1)

        main = [r for r in plan if not r.is_pressure]
        pressure = [r for r in plan if r.is_pressure]
        results = asyncio.run(run_plan(main, target, config.concurrency, on_result))
        if pressure:  # all at once: more KV than a small pool holds, so the scheduler must preempt
            results += asyncio.run(run_plan(pressure, target, len(pressure), on_result))
    duration_s = time.monotonic() - started
    after = scrape_after_drain(config.root_url, config.admin_key, config.drain_timeout_s)
    run = {"base_url": config.base_url, "model": model, "max_context": max_context,
           "num_tenants": config.num_tenants, "num_requests": len(plan), "concurrency": config.concurrency,
           "oversized_fraction": config.oversized_fraction, "abort_fraction": config.abort_fraction,
           "max_tokens": config.max_tokens, "seed": config.seed, "n_fraction": config.n_fraction,
           "logprobs_fraction": config.logprobs_fraction,
           "prompt_logprobs_fraction": config.prompt_logprobs_fraction, "echo_fraction": config.echo_fraction,
           "tools_fraction": config.tools_fraction, "tools_not_sent": tools_not_sent,
           "pressure_requests": config.pressure_requests,
           "pressure_max_tokens": max((r.max_tokens for r in plan if r.is_pressure), default=None),
           "started_at": started_at.isoformat(timespec="seconds"), "duration_s": round(duration_s, 1)}
    return build_report(analyse(results), evidence(before, after), run, tenancy)
