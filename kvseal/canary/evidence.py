"""The server's own evidence, from kvseal's `/metrics` (absent metrics are reported, not fatal).

Read once before the run and once after it has drained: counter deltas say what the server
saw during the run (requests by outcome, which equals its audit lines per outcome; isolation
checks tripped; pages scrubbed), gauges after the drain say whether the allocator is back to
idle (no page still owned, every page free again). Any other OpenAI-compatible server simply
has no such evidence, and the report says so.

Preemptions are the change of `kvseal_num_preemptions` (a gauge of the engines' count since they
started): a request whose pages were taken by the scheduler and given back later. A gauge that
went down over the run (an engine restarted and counts from 0) says nothing about the run, so it
is "unavailable" then, never a guess.

Pages scrubbed is read with the scrub mode the server runs (`kvseal_kv_scrub_mode`): with the
default `--kv-scrub off` it is 0 by design (a freed page keeps its KV until its next owner
overwrites it, and the always-on checks are what keep a request from reading it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

REQUESTS = "kvseal_requests_total"
REJECTIONS = "kvseal_rejections_total"
ISOLATION_VIOLATIONS = "kvseal_isolation_violations_total"
PAGES_SCRUBBED = "kvseal_kv_pages_scrubbed_total"
SCRUB_MODE = "kvseal_kv_scrub_mode"
PAGES_USED = "kvseal_kv_pages_used"
PAGES_FREE = "kvseal_kv_pages_free"
RUNNING = "kvseal_num_requests_running"
WAITING = "kvseal_num_requests_waiting"
PREEMPTIONS = "kvseal_num_preemptions"
DRAIN_POLL_S = 0.2


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


@dataclass
class MetricsSnapshot:
    """One scrape of /metrics, or why there is none."""

    samples: list[Sample] = field(default_factory=list)
    unavailable: str | None = None

    def total(self, name: str) -> float | None:
        values = [s.value for s in self.samples if s.name == name]
        return sum(values) if values else None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.samples:
            if s.name == name:
                key = dict(s.labels).get(label, "")
                out[key] = out.get(key, 0.0) + s.value
        return out

    def names(self) -> set[str]:
        return {s.name for s in self.samples}


def scrape(root_url: str, admin_key: str | None, timeout_s: float = 10.0) -> MetricsSnapshot:
    headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
    try:
        resp = httpx.get(f"{root_url}/metrics", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return MetricsSnapshot(unavailable=f"GET /metrics failed: {type(exc).__name__}: {exc}")
    if resp.status_code in (401, 403):
        hint = "" if admin_key else " (pass --admin-key with an admin key of the server)"
        return MetricsSnapshot(unavailable=f"GET /metrics answered {resp.status_code}{hint}")
    if resp.status_code != 200:
        return MetricsSnapshot(unavailable=f"GET /metrics answered {resp.status_code}")
    try:
        return MetricsSnapshot(_parse(resp.text))
    except ValueError as exc:
        return MetricsSnapshot(unavailable=f"/metrics is not Prometheus text: {exc}")


def _parse(text: str) -> list[Sample]:
    return [Sample(s.name, tuple(sorted(s.labels.items())), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


def scrape_after_drain(root_url: str, admin_key: str | None, drain_timeout_s: float) -> MetricsSnapshot:
    """Scrape until the engine reports nothing running, waiting or owning pages (bounded)."""
    end = time.monotonic() + drain_timeout_s
    while True:
        snap = scrape(root_url, admin_key)
        if snap.unavailable or _is_idle(snap) or time.monotonic() >= end:
            return snap
        time.sleep(DRAIN_POLL_S)


def _is_idle(snap: MetricsSnapshot) -> bool:
    return all(snap.total(name) in (None, 0.0) for name in (RUNNING, WAITING, PAGES_USED))


def evidence(before: MetricsSnapshot, after: MetricsSnapshot) -> dict[str, Any]:
    """What the server says about the run; every item is a value or 'unavailable'."""
    if before.unavailable or after.unavailable:
        return {"available": False, "reason": after.unavailable or before.unavailable}
    return {
        "available": True,
        "requests_by_outcome": _delta_by_label(before, after, REQUESTS, "outcome"),
        "rejections_by_reason": _delta_by_label(before, after, REJECTIONS, "reason"),
        "isolation_violations": _delta(before, after, ISOLATION_VIOLATIONS),
        "pages_scrubbed": _delta(before, after, PAGES_SCRUBBED),
        "preemptions": _gauge_rise(before, after, PREEMPTIONS),
        "scrub_mode": _scrub_mode(after),
        "allocator_after_run": _allocator(before, after),
    }


def _delta(before: MetricsSnapshot, after: MetricsSnapshot, name: str) -> float | str:
    a = after.total(name)
    if a is None:
        return "unavailable"
    return a - (before.total(name) or 0.0)


def _gauge_rise(before: MetricsSnapshot, after: MetricsSnapshot, name: str) -> float | str:
    """How much a since-start count rose over the run; 'unavailable' if it is absent or fell."""
    a, b = after.total(name), before.total(name)
    if a is None or b is None or a < b:
        return "unavailable"
    return a - b


def _delta_by_label(before: MetricsSnapshot, after: MetricsSnapshot, name: str, label: str) -> dict[str, float] | str:
    if name not in after.names():
        return "unavailable"
    old = before.by_label(name, label)
    return {k: v - old.get(k, 0.0) for k, v in sorted(after.by_label(name, label).items()) if v - old.get(k, 0.0)}


def _scrub_mode(after: MetricsSnapshot) -> str:
    """The `mode` label of the series at 1 (off, free, alloc, checked, or PD roles that differ)."""
    modes = sorted(mode for mode, value in after.by_label(SCRUB_MODE, "mode").items() if value == 1)
    return ",".join(modes) if modes else "unavailable"


def _allocator(before: MetricsSnapshot, after: MetricsSnapshot) -> dict[str, Any] | str:
    used, free = after.total(PAGES_USED), after.total(PAGES_FREE)
    if used is None or free is None:
        return "unavailable"
    # Before the first request an engine may not have reported its pool yet (both gauges 0).
    total_before = (before.total(PAGES_USED) or 0.0) + (before.total(PAGES_FREE) or 0.0)
    is_whole = total_before == 0 or free == total_before
    return {"pages_used": used, "pages_free": free, "pages_total": used + free,
            "pages_total_before": total_before or "unknown", "is_idle": used == 0 and free > 0 and is_whole}
