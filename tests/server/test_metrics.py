"""`/metrics`' pages-scrubbed counter stays monotone whatever the engines' own counts do, the
scrub mode series names the policy the engines run (I7), and removed tenants' series go."""

from __future__ import annotations

from kvseal.canary.evidence import MetricsSnapshot, _parse
from kvseal.messages.msgs import EngineStatsMsg
from kvseal.server.metrics import ServerMetrics
from kvseal.totals import CumulativeTotal


def test_a_cumulative_total_never_goes_backwards() -> None:
    total = CumulativeTotal()
    assert [total.observe("a", n) for n in (0, 3, 3, 7)] == [0, 3, 0, 4]
    assert total.observe("b", 5) == 5, "a new source counts from 0"
    assert total.observe("a", 2) == 2, "a count below the last one is a restart: all of it is new"
    assert total.observe("a", 6) == 4
    assert total.total == 7 + 5 + 2 + 4


def _snapshot(metrics: ServerMetrics) -> MetricsSnapshot:
    return MetricsSnapshot(_parse(metrics.render().decode()))


def _stats(num_pages_scrubbed: int) -> EngineStatsMsg:
    return EngineStatsMsg(0, 0, 0, 16, 0, num_pages_scrubbed=num_pages_scrubbed)


def test_the_counter_follows_the_engine_count_and_survives_a_restart() -> None:
    metrics = ServerMetrics()
    assert _snapshot(metrics).total("kvseal_kv_pages_scrubbed_total") == 0
    for count in (4, 9, 9):
        metrics.record_stats(_stats(count))
    assert _snapshot(metrics).total("kvseal_kv_pages_scrubbed_total") == 9
    metrics.record_stats(_stats(2))  # an engine that started again
    assert _snapshot(metrics).total("kvseal_kv_pages_scrubbed_total") == 11
    metrics.reset_engine_gauges()  # the engine went away: what it scrubbed stays counted
    assert _snapshot(metrics).total("kvseal_kv_pages_scrubbed_total") == 11


def test_the_scrub_mode_series_names_one_policy() -> None:
    metrics = ServerMetrics()
    metrics.record_scrub_mode("off")
    metrics.record_scrub_mode("free")
    assert _snapshot(metrics).by_label("kvseal_kv_scrub_mode", "mode") == {"free": 1.0}


def test_forgetting_tenants_removes_every_series_of_theirs_and_only_theirs() -> None:
    metrics = ServerMetrics()
    for tenant in ("kept", "gone-1", "gone-2"):
        metrics.record_outcome(tenant, "finished", None)
        metrics.record_outcome(tenant, "rejected", "concurrency_limit_exceeded")
        metrics.record_usage(tenant, 10, 5, 4)
        metrics.record_prefix_cache(tenant, 10, 4)
    metrics.forget_tenants({"kept"})
    text = metrics.render().decode()
    assert 'tenant="gone-' not in text
    assert text.count('tenant="kept"') == 2 * 8  # 8 series (2 of kvseal_requests), each with its _created
    assert _snapshot(metrics).total("kvseal_prompt_tokens_total") == 10
