"""`/metrics`' pages-scrubbed counter stays monotone whatever the engines' own counts do, the
scrub mode series names the policy the engines run (I7), and removed tenants' series go."""

from __future__ import annotations

import dataclasses

from prometheus_client.parser import text_string_to_metric_families

from kvseal.canary.evidence import MetricsSnapshot, _parse
from kvseal.messages.msgs import EngineStatsMsg, RequestTimingMsg
from kvseal.server.metrics import ServerMetrics
from kvseal.server.vllm_metrics import RequestSizes
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
    metrics = _named()
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


# ---- vLLM's names (kvseal.server.vllm_metrics) ----

VLLM_SERIES = {  # name: (type, extra labels), as vLLM's PrometheusStatLogger defines them
    "vllm:num_requests_running": ("gauge", ()), "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:kv_cache_usage_perc": ("gauge", ()),
    "vllm:prompt_tokens": ("counter", ()), "vllm:generation_tokens": ("counter", ()),
    "vllm:num_preemptions": ("counter", ()), "vllm:request_success": ("counter", ("finished_reason",)),
    "vllm:prefix_cache_queries": ("counter", ()), "vllm:prefix_cache_hits": ("counter", ()),
    "vllm:time_to_first_token_seconds": ("histogram", ()), "vllm:inter_token_latency_seconds": ("histogram", ()),
    "vllm:e2e_request_latency_seconds": ("histogram", ()),
    "vllm:request_queue_time_seconds": ("histogram", ()), "vllm:request_prefill_time_seconds": ("histogram", ()),
    "vllm:request_decode_time_seconds": ("histogram", ()), "vllm:request_inference_time_seconds": ("histogram", ()),
    "vllm:request_prompt_tokens": ("histogram", ()), "vllm:request_generation_tokens": ("histogram", ()),
    "vllm:request_params_n": ("histogram", ()), "vllm:request_params_max_tokens": ("histogram", ()),
    "vllm:request_max_num_generation_tokens": ("histogram", ()),
}
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50]  # vLLM's build_1_2_5_buckets(max_model_len), max_model_len 64
VLLM_BUCKETS = {  # vLLM's own lists, copied here so a change on either side shows
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                         7.5, 10.0, 20.0, 40.0, 80.0],
    **dict.fromkeys(["vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                     "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                     "vllm:request_inference_time_seconds"], REQUEST_LATENCY_BUCKETS),
    "vllm:request_params_n": [1, 2, 5, 10, 20],
    **dict.fromkeys(["vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_max_tokens",
                     "vllm:request_max_num_generation_tokens"], TOKEN_BUCKETS),
}
MODEL_LABELS = (("engine", "0"), ("model_name", "served-model"))
MAX_MODEL_LEN = 64


def _named() -> ServerMetrics:
    metrics = ServerMetrics()
    metrics.vllm.name_model("served-model", MAX_MODEL_LEN)
    return metrics


def _load(num_running: int, num_pages_used: int, num_preemptions: int,
          num_preemptions_total: int | None = None) -> EngineStatsMsg:
    return EngineStatsMsg(num_running, 1, num_pages_used, 16 - num_pages_used, num_preemptions,
                          num_preemptions_total=num_preemptions_total)


def test_the_vllm_series_have_vllms_names_types_labels_and_buckets() -> None:
    metrics = _named()
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    for name, (kind, extra) in VLLM_SERIES.items():
        family = families[name]
        assert family.type == kind, name
        assert family.samples, f"{name} is shown from the start, as vLLM's are"
        for sample in family.samples:
            assert set(sample.labels) == {"model_name", "engine", *extra, *(["le"] if sample.name.endswith(
                "_bucket") else [])}, sample
            assert (sample.labels["model_name"], sample.labels["engine"]) == ("served-model", "0")
    for name, buckets in VLLM_BUCKETS.items():
        les = [float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")]
        assert les == [*buckets, float("inf")], name
    assert set(_snapshot(metrics).by_label("vllm:request_success_total", "finished_reason")) == {
        "stop", "length", "abort"}


def test_the_vllm_series_are_fed_by_the_kvseal_measurements() -> None:
    metrics = _named()
    metrics.record_usage("alice", 10, 5, 4)
    metrics.record_usage("bob", 7, 3, 0)
    metrics.record_prefix_cache("alice", 10, 4)
    metrics.record_first_token(0.03)
    metrics.record_inter_token(0.02)
    metrics.record_finished("length", 1.2)
    metrics.record_finished("abort", 0.4)
    snap = _snapshot(metrics)
    assert snap.total("vllm:prompt_tokens_total") == snap.total("kvseal_prompt_tokens_total") == 17
    assert snap.total("vllm:generation_tokens_total") == snap.total("kvseal_completion_tokens_total") == 8
    assert (snap.total("vllm:prefix_cache_queries_total"), snap.total("vllm:prefix_cache_hits_total")) == (10, 4)
    assert snap.total("vllm:time_to_first_token_seconds_count") == snap.total(
        "kvseal_time_to_first_token_seconds_count") == 1
    assert snap.total("vllm:inter_token_latency_seconds_sum") == snap.total("kvseal_inter_token_latency_seconds_sum")
    assert snap.by_label("vllm:request_success_total", "finished_reason") == {"stop": 0, "length": 1, "abort": 1}
    assert snap.total("vllm:e2e_request_latency_seconds_count") == 2
    assert dict(next(s for s in snap.samples if s.name == "vllm:prompt_tokens_total").labels) == dict(MODEL_LABELS)


def test_a_request_is_observed_by_its_sizes_and_its_engines_phases() -> None:
    metrics = _named()
    sizes = RequestSizes(num_prompt_tokens=7, num_generation_tokens=9, max_num_generation_tokens=5, n=2, max_tokens=5)
    metrics.vllm.record_request(sizes, RequestTimingMsg(queue_s=0.25, prefill_s=0.5, decode_s=2.0))
    metrics.vllm.record_request(dataclasses.replace(sizes, n=1, max_tokens=40), None)  # ended before a token
    snap = _snapshot(metrics)
    assert [snap.total(f"vllm:request_{name}_sum") for name in ("prompt_tokens", "generation_tokens",
            "max_num_generation_tokens", "params_n", "params_max_tokens")] == [14, 18, 10, 3, 45]
    assert [snap.total(f"vllm:request_{phase}_time_seconds_count") for phase in PHASES] == [1, 1, 1, 1]
    assert [snap.total(f"vllm:request_{phase}_time_seconds_sum") for phase in PHASES] == [0.25, 0.5, 2.0, 2.5]


PHASES = ("queue", "prefill", "decode", "inference")


def test_kv_cache_usage_is_the_fraction_of_pages_held_and_zero_once_the_engine_is_gone() -> None:
    metrics = _named()
    metrics.record_stats(_load(num_running=2, num_pages_used=4, num_preemptions=0))
    snap = _snapshot(metrics)
    assert snap.total("vllm:kv_cache_usage_perc") == 0.25
    assert (snap.total("vllm:num_requests_running"), snap.total("vllm:num_requests_waiting")) == (2, 1)
    metrics.reset_engine_gauges()
    snap = _snapshot(metrics)
    assert [snap.total(name) for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                                          "vllm:num_requests_waiting")] == [0, 0, 0]


def test_the_preemption_counter_never_goes_back_across_an_engine_restart() -> None:
    metrics = _named()
    seen = []
    for count in (3, 5, 5, 2, 4):  # the engine restarted after 5: it counts from 0 again
        metrics.record_stats(_load(1, 4, count))
        seen.append(_snapshot(metrics).total("vllm:num_preemptions_total"))
    assert seen == [3, 5, 5, 7, 9]
    metrics.reset_engine_gauges()  # the engine is gone: what it counted stays counted
    assert _snapshot(metrics).total("vllm:num_preemptions_total") == 9
    assert _snapshot(metrics).total("kvseal_num_preemptions") == 0  # kvseal's gauge is unchanged


def test_the_preemption_counter_follows_the_pd_frontends_total_not_its_sum() -> None:
    """PD: the summed count drops when one engine restarts; the frontend's total does not."""
    metrics = _named()
    for summed, total in ((8, 8), (5, 8), (6, 9)):  # prefill (3 of the 8) restarted, then preempted once
        metrics.record_stats(_load(1, 4, summed, num_preemptions_total=total))
    assert _snapshot(metrics).total("vllm:num_preemptions_total") == 9


def test_load_reported_before_the_model_is_named_is_shown_once_it_is() -> None:
    metrics = ServerMetrics()
    metrics.record_stats(_load(1, 8, 2))
    assert "vllm:num_preemptions_total" not in _snapshot(metrics).names()
    metrics.vllm.name_model("served-model", MAX_MODEL_LEN)
    snap = _snapshot(metrics)
    assert (snap.total("vllm:num_preemptions_total"), snap.total("vllm:kv_cache_usage_perc")) == (2, 0.5)
