"""Per-engine /metrics series live while their engine instance is up: an engine that goes down,
or comes back as a new instance, takes its old series with it; `kvseal_pd_engine_up` stays."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvseal.disagg.frontend import EngineLink
from kvseal.disagg.metrics import PdMetrics
from kvseal.disagg.msgs import PdStatsMsg
from kvseal.messages.msgs import EngineStatsMsg


def stats(instance_id: str) -> PdStatsMsg:
    return PdStatsMsg(instance_id, "decode", EngineStatsMsg(1, 0, 7, 9, 0), 16, 2, 3, 4096, 0.5,
                      {"transfer_failed": 1}, 0, 0, 0)


def series_of(registry: CollectorRegistry, instance_id: str) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if f'engine="{instance_id}"' in line]


def test_a_down_or_restarted_engines_series_are_removed() -> None:
    registry = CollectorRegistry()
    metrics = PdMetrics(registry)
    link = EngineLink("decode", "127.0.0.1:9002", b"key", socket=None)  # type: ignore[arg-type]  # unused here
    link.is_up, link.stats = True, stats("decode-aaaa")
    metrics.record(link)
    assert len(series_of(registry, "decode-aaaa")) == 9  # six gauges, two refusal kinds, one failure reason
    link.is_up, link.stats = False, None  # what PdClient._engine_down does
    metrics.record(link)
    assert series_of(registry, "decode-aaaa") == []
    text = generate_latest(registry).decode()
    assert 'kvseal_pd_engine_up{address="127.0.0.1:9002",role="decode"} 0.0' in text
    link.is_up, link.stats = True, stats("decode-bbbb")
    metrics.record(link)
    link.stats = stats("decode-cccc")  # restarted as a new instance before it was seen down
    metrics.record(link)
    assert series_of(registry, "decode-bbbb") == [] and len(series_of(registry, "decode-cccc")) == 9
