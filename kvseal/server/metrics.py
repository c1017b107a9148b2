"""Prometheus metrics for `/metrics`, in their own registry (one per server).

Series labelled by tenant exist for the tenants of the keys file: a key reload that removes a
tenant removes its series (`forget_tenants`), so tenants that come and go over a server's life
leave no series behind.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvseal.messages.msgs import EngineStatsMsg
from kvseal.server.audit import AuditStats
from kvseal.server.vllm_metrics import VllmMetrics
from kvseal.totals import CumulativeTotal

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvseal_requests", "Generation requests by tenant and outcome",
                                ["tenant", "outcome"], registry=r)
        self.rejections = Counter("kvseal_rejections", "Requests refused before generation, by tenant and reason "
                                  "(rate limits: requests_per_minute_exceeded, tokens_per_minute_exceeded, "
                                  "concurrency_limit_exceeded)", ["tenant", "reason"], registry=r)
        # Metering: the tokens of every request that reached the engine, as its usage reports them
        # (aborted ones included: their tokens were computed). Cached tokens are part of the prompt's.
        self.prompt_tokens = Counter("kvseal_prompt_tokens", "Prompt tokens by tenant (usage.prompt_tokens)",
                                     ["tenant"], registry=r)
        self.completion_tokens = Counter("kvseal_completion_tokens", "Generated tokens by tenant "
                                         "(usage.completion_tokens)", ["tenant"], registry=r)
        self.cached_tokens = Counter("kvseal_cached_tokens", "Prompt tokens served from the tenant's prefix cache "
                                     "(usage.prompt_tokens_details.cached_tokens)", ["tenant"], registry=r)
        self.isolation_violations = Counter(
            "kvseal_isolation_violations", "Requests failed closed because an isolation check tripped (engine or "
            "frontend); any non-zero value is an incident", registry=r)
        self.ttft = Histogram("kvseal_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("kvseal_inter_token_latency_seconds", "Time between consecutive generated tokens",
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.running = Gauge("kvseal_num_requests_running", "Requests the engine is running", registry=r)
        self.waiting = Gauge("kvseal_num_requests_waiting", "Requests queued in the engine", registry=r)
        self.pages_used = Gauge("kvseal_kv_pages_used", "KV cache pages owned by requests", registry=r)
        self.pages_free = Gauge("kvseal_kv_pages_free", "KV cache pages free", registry=r)
        self.preemptions = Gauge("kvseal_num_preemptions", "Preemptions since the engine started", registry=r)
        self.prefix_cache_queries = Counter(
            "kvseal_prefix_cache_queries", "Prompt tokens looked up in the tenant's prefix cache (I5), counted "
            "in tokens as vLLM does", ["tenant"], registry=r)
        self.prefix_cache_hits = Counter(
            "kvseal_prefix_cache_hits", "Prompt tokens served from the tenant's own prefix cache (I5)",
            ["tenant"], registry=r)
        self.engine_up = Gauge("kvseal_engine_up", "1 while the engine process is alive and ready", registry=r)
        self.pages_scrubbed = Counter(
            "kvseal_kv_pages_scrubbed", "KV pages the scrub policy (I7) overwrote: zeroed on free with --kv-scrub "
            "free, on hand-out with alloc, NaN-poisoned on free and zeroed on hand-out with --check-kv; stays 0 "
            "with --kv-scrub off (a page's next owner overwrites it)", registry=r)
        self._pages_scrubbed_seen = CumulativeTotal()
        self.grammar_workers_ready = Gauge(
            "kvseal_grammar_workers_ready", "Structured-output grammar worker processes started and serving",
            registry=r)
        self.grammar_compiles_running = Gauge(
            "kvseal_grammar_compiles_running", "Grammar compiles running (at most one per tenant)", registry=r)
        self.grammar_compiles_queued = Gauge(
            "kvseal_grammar_compiles_queued", "Grammar compiles waiting for a worker", registry=r)
        self.grammar_compile_timeouts = Gauge(
            "kvseal_grammar_compile_timeouts", "Grammar compiles stopped at --grammar-compile-timeout-s of CPU "
            "time (the request got a 400), or at thirty times it in wall time on a busy host (a 503), since the engine "
            "started", registry=r)
        self.grammar_compiles_cancelled = Gauge(
            "kvseal_grammar_compiles_cancelled", "Grammar compiles dropped or stopped because every request waiting "
            "for them ended (abort, disconnect) since the engine started", registry=r)
        self.scrub_mode = Gauge(
            "kvseal_kv_scrub_mode", "1 for the engines' page scrub policy (I7): off, free, alloc or checked "
            "(--check-kv); PD engines that differ are listed as role=policy", ["mode"], registry=r)
        self.audit_up = Gauge(
            "kvseal_audit_log_up", "1 while the audit log (I8) can be written; at 0 answers are withheld and "
            "generation requests refused with 503 audit_unavailable", registry=r)
        self.audit_write_failures = Counter(
            "kvseal_audit_write_failures", "Writes to the audit log that failed (a full disk, a read-only or "
            "missing directory); each retry counts", registry=r)
        self.audit_pending = Gauge("kvseal_audit_records_pending", "Audit records waiting for the audit log to "
                                   "work again", registry=r)
        self.audit_dropped = Counter(
            "kvseal_audit_records_dropped", "Audit records lost because too many waited for a failing audit "
            "log; any non-zero value is an incident", registry=r)
        self._audit_seen = CumulativeTotal()
        self.model_enabled = Gauge(
            "kvseal_model_enabled", "1 while the model takes requests, 0 while the operator's kill switch is on "
            "(POST /admin/models/{id}/disable)", ["model"], registry=r)
        self.tenant_cache_forgets = Counter(
            "kvseal_tenant_cache_forgets", "Tenant names whose prefix cache the engines were told to forget: every "
            "key of the name removed by a key reload (reason tenant_removed), or POST "
            "/admin/tenants/{name}/forget-cache (reason operator)", ["reason"], registry=r)
        self.vllm = VllmMetrics(r)  # vLLM's names, fed below by the same measurements

    def forget_tenants(self, kept: set[str]) -> None:
        """Remove every tenant-labelled series of a tenant not in `kept`."""
        for counter, label_names in self._per_tenant():
            stale = {tuple(sample.labels[name] for name in label_names)
                     for family in counter.collect() for sample in family.samples
                     if sample.labels["tenant"] not in kept}
            for label_values in stale:
                counter.remove(*label_values)

    def _per_tenant(self) -> list[tuple[Counter, tuple[str, ...]]]:
        by_tenant = ("tenant",)
        return [(self.requests, ("tenant", "outcome")), (self.rejections, ("tenant", "reason")),
                (self.prompt_tokens, by_tenant), (self.completion_tokens, by_tenant),
                (self.cached_tokens, by_tenant), (self.prefix_cache_queries, by_tenant),
                (self.prefix_cache_hits, by_tenant)]

    def record_audit(self, stats: AuditStats) -> None:
        """The audit log's state (I8), as it is when /metrics is read."""
        self.audit_up.set(1 if stats.is_up else 0)
        self.audit_pending.set(stats.num_pending)
        self.audit_write_failures.inc(self._audit_seen.observe("failures", stats.num_write_failures))
        self.audit_dropped.inc(self._audit_seen.observe("dropped", stats.num_dropped))

    def record_model_enabled(self, model: str, is_enabled: bool) -> None:
        self.model_enabled.labels(model=model).set(1 if is_enabled else 0)

    def record_outcome(self, tenant: str, outcome: str, rejection_reason: str | None) -> None:
        self.requests.labels(tenant=tenant, outcome=outcome).inc()
        if rejection_reason is not None:
            self.rejections.labels(tenant=tenant, reason=rejection_reason).inc()

    def record_usage(self, tenant: str, num_prompt_tokens: int, num_completion_tokens: int,
                     num_cached_tokens: int) -> None:
        """One request's tokens, as its usage reports them."""
        self.prompt_tokens.labels(tenant=tenant).inc(num_prompt_tokens)
        self.completion_tokens.labels(tenant=tenant).inc(num_completion_tokens)
        self.cached_tokens.labels(tenant=tenant).inc(num_cached_tokens)
        self.vllm.record_usage(num_prompt_tokens, num_completion_tokens)

    def record_prefix_cache(self, tenant: str, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """One request that reached the engine: its prompt tokens queried, those served from the cache hit."""
        self.prefix_cache_queries.labels(tenant=tenant).inc(num_prompt_tokens)
        self.prefix_cache_hits.labels(tenant=tenant).inc(num_cached_tokens)
        self.vllm.record_prefix_cache(num_prompt_tokens, num_cached_tokens)

    def record_first_token(self, ttft_s: float) -> None:
        """Arrival to a request's first generated token."""
        self.ttft.observe(ttft_s)
        self.vllm.record_first_token(ttft_s)

    def record_inter_token(self, itl_s: float) -> None:
        """One output of a request to its next."""
        self.itl.observe(itl_s)
        self.vllm.record_inter_token(itl_s)

    def record_finished(self, finish_reason: str, e2e_s: float) -> None:
        """A request the engine ended (stop, length, abort), `e2e_s` after its arrival."""
        self.vllm.record_finished(finish_reason, e2e_s)

    def record_stats(self, stats: EngineStatsMsg) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.pages_used.set(stats.num_pages_used)
        self.pages_free.set(stats.num_pages_free)
        self.preemptions.set(stats.num_preemptions)
        self.pages_scrubbed.inc(self._pages_scrubbed_seen.observe("engine", stats.num_pages_scrubbed))
        self.grammar_workers_ready.set(stats.num_grammar_workers_ready)
        self.grammar_compiles_running.set(stats.num_grammar_compiles_running)
        self.grammar_compiles_queued.set(stats.num_grammar_compiles_queued)
        self.grammar_compile_timeouts.set(stats.num_grammar_compile_timeouts)
        self.grammar_compiles_cancelled.set(stats.num_grammar_compiles_cancelled)
        self.vllm.record_load(stats)

    def record_scrub_mode(self, mode: str) -> None:
        """The one series at 1 names the engines' scrub policy as they run now."""
        self.scrub_mode.clear()
        self.scrub_mode.labels(mode=mode).set(1)

    def reset_engine_gauges(self) -> None:
        """The engine is gone: its last load figures are stale, report zero."""
        for gauge in (self.running, self.waiting, self.pages_used, self.pages_free, self.preemptions,
                      self.grammar_workers_ready, self.grammar_compiles_running, self.grammar_compiles_queued):
            gauge.set(0)
        self.vllm.reset_load()

    def render(self) -> bytes:
        return generate_latest(self.registry)
