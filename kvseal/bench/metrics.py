"""Benchmark metrics with `vllm bench serve`'s definitions and JSON key names.

Over the successful requests of one run lasting `duration_s` (first send to last response):
- TTFT: send to first output chunk. E2EL: send to last output chunk.
- TPOT (time per output token, excluding the first): (E2EL - TTFT) / (output_len - 1), one
  value per request with output_len > 1.
- ITL: every gap between consecutive output chunks, pooled over all requests.
- throughputs: completed requests, output tokens, and input + output tokens per second.
Each latency gets mean_, median_, std_ and p<N>_ keys in milliseconds; an empty list gives 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvseal.bench.client import RequestResult

LATENCIES = (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
             ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency"))
PERCENTILES = (99.0,)


def compute_metrics(results: Sequence[RequestResult], duration_s: float,
                    percentiles: Sequence[float] = PERCENTILES) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_input = sum(r.input_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    for name, values_s in _latency_lists(ok).items():
        out.update(_summary(name, values_s, percentiles))
    return out


def _latency_lists(ok: Sequence[RequestResult]) -> dict[str, list[float]]:
    return {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [(r.latency_s - r.ttft_s) / (r.output_len - 1) for r in ok if r.output_len > 1],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2el": [r.latency_s for r in ok],
    }


def _summary(name: str, values_s: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{_percentile_label(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def _percentile_label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def per_request_lists(results: Sequence[RequestResult]) -> dict[str, Any]:
    """The raw per-request values vLLM also saves (seconds), plus the error of each failure."""
    ok = [r for r in results if r.success]
    return {
        "input_lens": [r.input_len for r in ok], "output_lens": [r.output_len for r in ok],
        "ttfts": [r.ttft_s for r in ok], "e2els": [r.latency_s for r in ok], "itls": [r.itl_s for r in ok],
        "errors": [r.error for r in results if not r.success],
    }


def format_summary(metrics: dict[str, Any], title: str = "Serving Benchmark Result",
                   percentiles: Sequence[float] = PERCENTILES) -> str:
    """The table `vllm bench serve` prints, from a metrics dict."""
    rows = [
        ("Successful requests:", f"{metrics['completed']}"),
        ("Failed requests:", f"{metrics['failed']}"),
        ("Benchmark duration (s):", f"{metrics['duration']:.2f}"),
        ("Total input tokens:", f"{metrics['total_input_tokens']}"),
        ("Total generated tokens:", f"{metrics['total_output_tokens']}"),
        ("Request throughput (req/s):", f"{metrics['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{metrics['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{metrics['total_token_throughput']:.2f}"),
    ]
    lines = [f"{f' {title} ':=^50}"] + [f"{a:<40}{b:<10}" for a, b in rows]
    for name, heading in LATENCIES:
        lines.append(f"{heading:-^50}")
        lines.append(f"{f'Mean {name.upper()} (ms):':<40}{metrics[f'mean_{name}_ms']:<10.2f}")
        lines.append(f"{f'Median {name.upper()} (ms):':<40}{metrics[f'median_{name}_ms']:<10.2f}")
        for p in percentiles:
            label = _percentile_label(p)
            lines.append(f"{f'P{label} {name.upper()} (ms):':<40}{metrics[f'p{label}_{name}_ms']:<10.2f}")
    for key, heading in (("peak_rss_bytes", "Peak server RSS (MiB):"), ("kv_pages_total", "KV pool (pages):"),
                         ("peak_kv_pages_used", "Peak KV pages used:")):
        if metrics.get(key) is not None:
            value = metrics[key] / 2**20 if key == "peak_rss_bytes" else metrics[key]
            lines.append(f"{heading:<40}{value:<10.1f}" if key == "peak_rss_bytes" else f"{heading:<40}{value:<10}")
    lines.append("=" * 50)
    return "\n".join(lines)
