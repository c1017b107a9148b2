"""The PD backend's own /metrics gauges: per engine and role, from each engine's `PdStatsMsg`.

A series labelled with an engine instance lives while that instance is up: when its engine goes
down (died, hung, restarted as a new instance) its series are removed, so /metrics never shows
a dead engine's last figures as if they were current. `kvseal_pd_engine_up` stays, by address.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge

if TYPE_CHECKING:
    from kvseal.disagg.frontend import EngineLink


class PdMetrics:
    """Per-engine handoff metrics for /metrics, from each engine's `PdStatsMsg`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["role", "engine"]
        r = registry
        self.up = Gauge("kvseal_pd_engine_up", "1 while the engine answers", ["role", "address"], registry=r)
        self.transfers = Gauge("kvseal_pd_kv_transfers", "KV handoffs completed", labels, registry=r)
        self.bytes = Gauge("kvseal_pd_kv_transfer_bytes", "KV bytes moved by handoffs", labels, registry=r)
        self.seconds = Gauge("kvseal_pd_kv_transfer_seconds", "Prefill admission to commit, summed over "
                             "handoffs (divide by transfers for the mean)", labels, registry=r)
        self.failures = Gauge("kvseal_pd_handoff_failures", "Handoffs that failed or were refused, by reason",
                              [*labels, "reason"], registry=r)
        self.expired = Gauge("kvseal_pd_reservations_expired", "Decode reservations released for lack of a "
                             "commit", labels, registry=r)
        self.reservations = Gauge("kvseal_pd_reservations", "Decode pages held for transfers, in reservations",
                                  labels, registry=r)
        self.pages_used = Gauge("kvseal_pd_kv_pages_used", "KV pages owned", labels, registry=r)
        self.link_refusals = Gauge("kvseal_pd_link_refusals", "Engine link refusals (I9): handshakes refused "
                                   "(kind=handshake; reason unlisted_key, not_curve, bad_crypto, protocol_error, "
                                   "incomplete), and messages the sender's role may not send (kind=message, "
                                   "reason=role)", [*labels, "kind", "reason"], registry=r)
        self._instance_gauges = (self.transfers, self.bytes, self.seconds, self.expired, self.reservations,
                                 self.pages_used)
        self._shown: dict[tuple[str, str], str] = {}  # (role, address) -> the instance its series are of
        self._failure_reasons: dict[str, set[str]] = {}  # instance -> reasons with a series
        self._refusal_reasons: dict[str, set[str]] = {}  # instance -> handshake refusal reasons with a series

    def _forget(self, role: str, instance_id: str) -> None:
        """Remove every series of the instance `instance_id`."""
        for gauge in self._instance_gauges:
            _remove(gauge, role, instance_id)
        _remove(self.link_refusals, role, instance_id, "message", "role")
        for reason in self._refusal_reasons.pop(instance_id, set()):
            _remove(self.link_refusals, role, instance_id, "handshake", reason)
        for reason in self._failure_reasons.pop(instance_id, set()):
            _remove(self.failures, role, instance_id, reason)

    def record(self, link: EngineLink) -> None:
        self.up.labels(role=link.role, address=link.address).set(1 if link.is_up else 0)
        stats = link.stats
        shown = self._shown.get((link.role, link.address))
        if shown is not None and (stats is None or stats.instance_id != shown):
            self._forget(link.role, shown)
            del self._shown[(link.role, link.address)]
        if stats is None:
            return
        self._shown[(link.role, link.address)] = stats.instance_id
        labels = dict(role=stats.role, engine=stats.instance_id)
        self.transfers.labels(**labels).set(stats.num_transfers)
        self.bytes.labels(**labels).set(stats.num_transfer_bytes)
        self.seconds.labels(**labels).set(stats.transfer_s_total)
        self.expired.labels(**labels).set(stats.num_reservations_expired)
        self.reservations.labels(**labels).set(stats.num_reservations)
        self.pages_used.labels(**labels).set(stats.engine.num_pages_used)
        self.link_refusals.labels(**labels, kind="message", reason="role").set(stats.num_refused_messages)
        for reason, count in stats.refused_handshakes.items():
            self.link_refusals.labels(**labels, kind="handshake", reason=reason).set(count)
            self._refusal_reasons.setdefault(stats.instance_id, set()).add(reason)
        for reason, count in stats.handoff_failures.items():
            self.failures.labels(**labels, reason=reason).set(count)
            self._failure_reasons.setdefault(stats.instance_id, set()).add(reason)


def _remove(gauge: Gauge, *label_values: str) -> None:
    try:
        gauge.remove(*label_values)
    except KeyError:
        pass  # never set
