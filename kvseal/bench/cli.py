"""Arguments of `kvseal bench serve` and `kvseal bench plot` (registered by kvseal/cli.py).

Imports nothing heavy at module level: `kvseal serve` parses its arguments through this parser too.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvseal.errors import KvsealError
from kvseal.output_files import check_output_file

if TYPE_CHECKING:
    from kvseal.bench.serve import ServeBenchConfig

DEFAULT_ENDPOINT = "/v1/completions"
_LONG_OPTIONS = ("long_api_key", "long_input_len", "long_output_len", "long_concurrency", "long_max_requests")


def add_bench_parser(sub: Any) -> None:
    """Add `bench` with its `serve` and `plot` subcommands to the top-level subparsers."""
    bench = sub.add_parser("bench", help="benchmark an OpenAI-compatible server (kvseal, vLLM, ...)")
    commands = bench.add_subparsers(dest="bench_command", required=True)
    _add_serve(commands.add_parser("serve", help="stream random prompts and report vLLM's serving metrics"))
    _add_plot(commands.add_parser("plot", help="plot throughput and p99 TTFT against concurrency"))


def _add_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="the server, as vLLM's bench takes it (http://127.0.0.1:8000) "
                   "or as an OpenAI base URL (http://127.0.0.1:8000/v1)")
    p.add_argument("--endpoint", default=DEFAULT_ENDPOINT, help="path of the completions API under the server's "
                   f"root, as in `vllm bench serve` (default {DEFAULT_ENDPOINT})")
    p.add_argument("--model", required=True, help="model name the server serves")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tokenizer", default=None, help="local model folder whose vocabulary the random "
                   "prompts use (default: the default model's)")
    p.add_argument("--num-prompts", type=int, default=200)
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=int, default=None,
                      help="requests in flight (default 32 without --request-rate); --max-concurrency is "
                           "vLLM's name")
    load.add_argument("--request-rate", type=float, default=None,
                      help="arrivals at this many requests/s, scheduled as vLLM's client does (with "
                           "--concurrency, also at most that many in flight; without, no limit)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="with --request-rate, vLLM's: 1 (default) Poisson arrivals, below 1 burstier, "
                           "above 1 more even, inf equal gaps")
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=256,
                   help="prompt tokens per request (--random-input-len: vLLM's name)")
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128,
                   help="output tokens per request (--random-output-len: vLLM's name)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--server-pid", type=int, default=None,
                   help="record the peak resident memory of this process and its children")
    p.add_argument("--admin-key", default=None,
                   help="key for kvseal's /metrics (needed for the KV pool figures when the server has --api-keys)")
    p.add_argument("--label", default=None, help="server name stored in the result (plot legend)")
    p.add_argument("--result-json", type=Path, default=None)
    p.add_argument("--no-progress", action="store_true")
    fair = p.add_argument_group("fairness mode (two tenants)")
    fair.add_argument("--fairness", action="store_true", help="measure --api-key's p99 TTFT alone and while "
                      "--long-api-key sends long prompts")
    fair.add_argument("--long-api-key", default=None, help="the long tenant's key (required)")
    fair.add_argument("--long-input-len", type=int, default=None, help="default 4096")
    fair.add_argument("--long-output-len", type=int, default=None, help="default 16")
    fair.add_argument("--long-concurrency", type=int, default=None, help="default 2")
    fair.add_argument("--long-max-requests", type=int, default=None, help="default 64")
    p.set_defaults(func=_cmd_serve)


def _add_plot(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", type=Path, help="result JSONs of `kvseal bench serve`")
    p.add_argument("-o", "--output", type=Path, required=True, help="PNG to write")
    p.add_argument("--title", default=None)
    p.set_defaults(func=_cmd_plot)


def config_from(ns: argparse.Namespace) -> ServeBenchConfig:
    from kvseal.bench.client import Endpoint
    from kvseal.bench.runner import LoadShape
    from kvseal.bench.serve import ServeBenchConfig

    if ns.request_rate is not None:
        shape = LoadShape(concurrency=ns.concurrency, request_rate=ns.request_rate, burstiness=ns.burstiness)
    else:
        shape = LoadShape(concurrency=32 if ns.concurrency is None else ns.concurrency, request_rate=math.inf)
    return ServeBenchConfig(
        endpoint=Endpoint(ns.base_url, ns.model, ns.api_key, ns.endpoint), shape=shape, num_prompts=ns.num_prompts,
        input_len=ns.input_len, output_len=ns.output_len, seed=ns.seed, tokenizer=ns.tokenizer,
        server_pid=ns.server_pid, admin_key=ns.admin_key, request_timeout_s=ns.request_timeout, label=ns.label,
        progress=not ns.no_progress,
    )


def _cmd_serve(ns: argparse.Namespace) -> int:
    from kvseal.bench.metrics import format_summary

    config = config_from(ns)
    given = [name for name in _LONG_OPTIONS if getattr(ns, name) is not None]
    if given and not ns.fairness:
        raise KvsealError(f"--{given[0].replace('_', '-')} only applies to the fairness mode; add --fairness")
    if ns.result_json is not None:
        check_output_file(ns.result_json, "--result-json", make_folder=True)
    if ns.fairness:
        result = _run_fairness(ns, config)
    else:
        from kvseal.bench.serve import bench_serve

        result = bench_serve(config)
        print(format_summary(result))
    if ns.result_json is not None:
        ns.result_json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["failed"] == 0 else 1


def _run_fairness(ns: argparse.Namespace, config: ServeBenchConfig) -> dict[str, Any]:
    from kvseal.bench.client import Endpoint
    from kvseal.bench.fairness import LongTenant, bench_fairness
    from kvseal.bench.metrics import format_summary

    overrides = {field: getattr(ns, f"long_{field}") for field in ("input_len", "output_len", "concurrency",
                                                                     "max_requests")}
    long = LongTenant(Endpoint(ns.base_url, ns.model, ns.long_api_key, ns.endpoint),
                      **{k: v for k, v in overrides.items() if v is not None})
    result = bench_fairness(config, long)
    print(format_summary(result["short_alone"], "Short tenant alone"))
    print(format_summary(result, "Short tenant with long load"))
    print(format_summary(result["long_tenant"], "Long tenant"))
    ratio = result["p99_ttft_ratio"]
    print(f"short tenant p99 TTFT: {result['short_alone_p99_ttft_ms']:.1f} ms alone, "
          f"{result['short_with_long_p99_ttft_ms']:.1f} ms with the long load "
          f"(ratio {'n/a' if ratio is None else f'{ratio:.2f}'})")
    return result


def _cmd_plot(ns: argparse.Namespace) -> int:
    from kvseal.bench.plot import plot_results

    out = plot_results(ns.results, ns.output, ns.title)
    print(f"wrote {out}")
    return 0
