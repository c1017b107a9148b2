"""vLLM's `/metrics` names beside kvseal's own, for dashboards, autoscalers and gateways built on
vLLM (Grafana boards, KEDA/HPA rules, the Gateway API Inference Extension's scheduler).

Names, types, labels and buckets are those of vLLM's `PrometheusStatLogger`
(`vllm/v1/metrics/loggers.py`): labels `model_name` (the served model name) and `engine` (always
"0": kvseal has one engine, or one PD pair whose figures are summed). Every series is fed by a
measurement kvseal already takes for its `kvseal_*` series; they are aggregates over tenants.

Where vLLM counts differently from the kvseal series beside it, these follow vLLM:
- `vllm:num_preemptions_total` is a counter that never goes back, where `kvseal_num_preemptions`
  is a gauge of the engines' count since they started (it drops when one restarts);
- `vllm:request_success_total` counts requests the engine ended, by finish reason (an abort
  included, as vLLM's `finished_reason="abort"`), not the frontend's outcomes;
- `vllm:kv_cache_usage_perc` is a fraction (0..1) of the pool, where kvseal reports pages.

The per-request phase histograms (queue, prefill, decode, inference) take the durations the
engine measured on its own clock and sent with the request's last output (`RequestTimingMsg`):
queue is from the engine queueing it to its first schedule, prefill from there to its first token,
decode from the first token to the last, inference the sum of the last two. A preemption keeps the
first schedule and the first token, as vLLM's does: its wait and recompute count in prefill or
decode. In PD mode queue and prefill are the prefill engine's (its wait before the request's first
prefill step, then the prefill), decode is decode's from its taking the handoff over: the KV
transfer between them is in none of the four (it is in TTFT and e2e). A request that ended before
its first token is in none of them (it is in `request_success` and e2e).

What stays different, and why (docs/OPERATIONS.md "Metrics"):
- token counters grow when a request ends (from its usage), not at each step as vLLM's do;
- a call with `n` choices is one request here (its latencies follow choice 0, its prompt is counted
  once, as usage reports it, its generation tokens are every choice's); vLLM counts each choice as a
  request of its own. `vllm:request_params_n` and `vllm:request_max_num_generation_tokens` (the
  most tokens one choice generated) are observed once per call, as vLLM observes them per parent;
- queue time starts when the engine queues the request: a structured-output request's grammar
  compile, before that, is in TTFT but not in the queue time (vLLM queues it while it compiles).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvseal.messages.msgs import EngineStatsMsg, RequestTimingMsg
from kvseal.totals import CumulativeTotal
from kvseal.types import FinishReason

# vLLM's buckets, as its PrometheusStatLogger defines them.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                             240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
LABELS = ("model_name", "engine")
ENGINE = "0"  # vLLM's engine index; kvseal has one engine (or PD pair) behind a server


class VllmMetrics:
    """vLLM-named series on `registry`. Their label values need the served model name, known once
    the engine is ready (`name_model`). Requests are served only from then on; the engines' load
    and preemptions reported before it are shown from then on."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                             LABELS, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                             LABELS, registry=r)
        self.kv_cache_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                    LABELS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         LABELS, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                   LABELS, registry=r)
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       [*LABELS, "finished_reason"], registry=r)
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number "
                                            "of queried tokens.", LABELS, registry=r)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                         "tokens.", LABELS, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LABELS, buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             LABELS, buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LABELS, buckets=REQUEST_LATENCY_BUCKETS_S, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase "
                                    "for request.", LABELS, buckets=REQUEST_LATENCY_BUCKETS_S, registry=r)
        self.inference_time = Histogram("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING "
                                        "phase for request.", LABELS, buckets=REQUEST_LATENCY_BUCKETS_S, registry=r)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL "
                                      "phase for request.", LABELS, buckets=REQUEST_LATENCY_BUCKETS_S, registry=r)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase "
                                     "for request.", LABELS, buckets=REQUEST_LATENCY_BUCKETS_S, registry=r)
        self.n_param = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", LABELS,
                                 buckets=N_BUCKETS, registry=r)
        self._registry = r
        self._sizes: _SizeHistograms | None = None  # their buckets follow max_model_len (`name_model`)
        self._model_name: str | None = None
        self._last_load: EngineStatsMsg | None = None
        self._preemptions_seen = CumulativeTotal()

    def name_model(self, model_name: str, max_model_len: int) -> None:
        """Label every series with the served model name (once; later calls are ignored), as vLLM
        creates them: gauges and counters at 0, one success series per finish reason. The token
        histograms' buckets go up to `max_model_len`, as vLLM's."""
        if self._model_name is not None:
            return
        self._model_name = model_name
        self._sizes = _SizeHistograms(self._registry, max_model_len)
        for metric in (self.running, self.waiting, self.kv_cache_usage, self.prompt_tokens, self.generation_tokens,
                       self.preemptions, self.prefix_cache_queries, self.prefix_cache_hits, self.ttft, self.itl,
                       self.e2e, self.queue_time, self.inference_time, self.prefill_time, self.decode_time,
                       self.n_param, *self._sizes.all):
            metric.labels(model_name, ENGINE)
        for reason in FinishReason:
            self.request_success.labels(model_name, ENGINE, reason.value)
        self.preemptions.labels(model_name, ENGINE).inc(self._preemptions_seen.total)
        if self._last_load is not None:
            self.record_load(self._last_load)

    def record_load(self, stats: EngineStatsMsg) -> None:
        """The engines' load and pool, and their preemption count (since each started)."""
        self._last_load = stats
        # One engine counts since it started (a restart counts from 0 again: all of it is new); the
        # PD frontend counts over every engine instance it saw, which never goes back.
        count = stats.num_preemptions if stats.num_preemptions_total is None else stats.num_preemptions_total
        grown = self._preemptions_seen.observe("engine", count)
        if self._model_name is None:
            return
        labels = (self._model_name, ENGINE)
        self.running.labels(*labels).set(stats.num_running)
        self.waiting.labels(*labels).set(stats.num_waiting)
        self.kv_cache_usage.labels(*labels).set(kv_cache_usage(stats))
        self.preemptions.labels(*labels).inc(grown)

    def reset_load(self) -> None:
        """The engine is gone: no request runs or waits, no page is held."""
        self._last_load = None
        if self._model_name is not None:
            for gauge in (self.running, self.waiting, self.kv_cache_usage):
                gauge.labels(self._model_name, ENGINE).set(0)

    def record_first_token(self, ttft_s: float) -> None:
        self._add(self.ttft, ttft_s)

    def record_inter_token(self, itl_s: float) -> None:
        self._add(self.itl, itl_s)

    def record_finished(self, finish_reason: str, e2e_s: float) -> None:
        """A request the engine ended, with its finish reason (stop, length, abort)."""
        self._add(self.request_success, 1, finished_reason=finish_reason)
        self._add(self.e2e, e2e_s)

    def record_request(self, sizes: RequestSizes, timing: RequestTimingMsg | None) -> None:
        """A request the engine ended (as `record_finished`): its sizes, and its phases where it had
        a first token (`timing`, the engine's durations)."""
        assert self._sizes is not None, "requests are served once the model is named"
        self._add(self._sizes.prompt_tokens, sizes.num_prompt_tokens)
        self._add(self._sizes.generation_tokens, sizes.num_generation_tokens)
        self._add(self._sizes.max_num_generation_tokens, sizes.max_num_generation_tokens)
        self._add(self._sizes.max_tokens, sizes.max_tokens)
        self._add(self.n_param, sizes.n)
        if timing is not None:
            self._add(self.queue_time, timing.queue_s)
            self._add(self.prefill_time, timing.prefill_s)
            self._add(self.decode_time, timing.decode_s)
            self._add(self.inference_time, timing.prefill_s + timing.decode_s)

    def record_usage(self, num_prompt_tokens: int, num_completion_tokens: int) -> None:
        self._add(self.prompt_tokens, num_prompt_tokens)
        self._add(self.generation_tokens, num_completion_tokens)

    def record_prefix_cache(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self._add(self.prefix_cache_queries, num_queried_tokens)
        self._add(self.prefix_cache_hits, num_hit_tokens)

    def _add(self, metric: Counter | Histogram, value: float, **extra: str) -> None:
        """Count `value` (a counter) or observe it (a histogram) under the model's labels."""
        assert self._model_name is not None, "requests are served once the engine is ready and the model named"
        child = metric.labels(model_name=self._model_name, engine=ENGINE, **extra)
        if isinstance(child, Counter):
            child.inc(value)
        else:
            child.observe(value)


@dataclass(frozen=True)
class RequestSizes:
    """One ended request's sizes, for vLLM's per-request histograms."""

    num_prompt_tokens: int  # usage.prompt_tokens
    num_generation_tokens: int  # usage.completion_tokens: every choice's
    max_num_generation_tokens: int  # the most tokens one choice generated
    n: int  # the request's `n`
    max_tokens: int  # the request's `max_tokens`, as the frontend resolved it


class _SizeHistograms:
    """vLLM's token-count histograms, whose buckets (1, 2, 5, 10, 20, 50, ...) stop at max_model_len."""

    def __init__(self, registry: CollectorRegistry, max_model_len: int) -> None:
        r, buckets = registry, buckets_1_2_5(max_model_len)
        self.prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                       LABELS, buckets=buckets, registry=r)
        self.generation_tokens = Histogram("vllm:request_generation_tokens", "Number of generation tokens "
                                           "processed.", LABELS, buckets=buckets, registry=r)
        self.max_num_generation_tokens = Histogram(
            "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            LABELS, buckets=buckets, registry=r)
        self.max_tokens = Histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request "
                                    "parameter.", LABELS, buckets=buckets, registry=r)

    @property
    def all(self) -> tuple[Histogram, ...]:
        return self.prompt_tokens, self.generation_tokens, self.max_num_generation_tokens, self.max_tokens


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's `build_1_2_5_buckets`)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def kv_cache_usage(stats: EngineStatsMsg) -> float:
    """vLLM's fraction of the KV pool in use: pages held (by requests, or by the prefix cache with
    readers) over all pages; evictable cached pages count as free, as vLLM's free queue does."""
    num_pages = stats.num_pages_used + stats.num_pages_free
    return stats.num_pages_used / num_pages if num_pages else 0.0
