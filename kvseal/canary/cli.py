"""`kvseal canary`: its flags, and the command (exit 0 pass, 1 fail, 2 bad usage)."""

from __future__ import annotations

import argparse
import logging
import sys

from kvseal.canary.config import CanaryConfig, load_keys
from kvseal.canary.plan import DEFAULT_PRESSURE_TOKENS
from kvseal.output_files import check_output_file


def add_canary_arguments(parser: argparse.ArgumentParser) -> None:
    d = CanaryConfig(base_url="http://x", keys=("a", "b"))
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000 (or .../v1)")
    parser.add_argument("--keys", required=True, metavar="FILE",
                        help='JSON list of API keys, one per tenant (at least 2, 8+ recommended): ["k1", "k2"]')
    parser.add_argument("--model", default=None, help="model id to request (default: the first in /v1/models)")
    parser.add_argument("--requests", type=int, default=d.num_requests)
    parser.add_argument("--concurrency", type=int, default=d.concurrency)
    parser.add_argument("--oversized-fraction", type=float, default=d.oversized_fraction,
                        help="share of prompts longer than the context limit (must be answered 4xx)")
    parser.add_argument("--abort-fraction", type=float, default=d.abort_fraction,
                        help="share of requests sent as streams and dropped mid-way")
    parser.add_argument("--n-fraction", type=float, default=d.n_fraction,
                        help="share of the answered requests sent with n = 2 or 3 (every choice is checked)")
    parser.add_argument("--logprobs-fraction", type=float, default=d.logprobs_fraction,
                        help="share of the answered requests sent with logprobs and 1-5 top alternatives "
                             "(every token string is checked)")
    parser.add_argument("--prompt-logprobs-fraction", type=float, default=d.prompt_logprobs_fraction,
                        help="share of the answered, non-streamed requests sent with vLLM's prompt_logprobs "
                             "(0 for a server without it)")
    parser.add_argument("--echo-fraction", type=float, default=d.echo_fraction,
                        help="share of the answered requests sent with echo (chat: vLLM's, continuing an "
                             "assistant message; 0 for a server without it)")
    parser.add_argument("--tools-fraction", type=float, default=d.tools_fraction,
                        help="share of the answered chat requests sent with one function tool and tool_choice "
                             "naming it, its arguments held to the request's marker (a forced call the tool "
                             "parser reads); left out, and the report says so, where the server refuses tools")
    parser.add_argument("--pressure-requests", type=int, default=d.pressure_requests, metavar="N",
                        help="after the run, send N long generations at once so a small KV pool must preempt "
                             "(default 0: no pressure phase)")
    parser.add_argument("--pressure-max-tokens", type=int, default=None, metavar="T",
                        help="max_tokens of each pressure request (default: what the context leaves, "
                             f"at most {DEFAULT_PRESSURE_TOKENS})")
    parser.add_argument("--max-context", type=int, default=None,
                        help="the server's context limit in tokens (default: max_model_len from /v1/models)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seeds markers, prompts and the request mix")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help="max_tokens of every request")
    parser.add_argument("--admin-key", default=None,
                        help="key allowed to read /metrics, for the server's own evidence (kvseal)")
    parser.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds per request")
    parser.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                        help="seconds to wait after the run for the server to report itself idle")
    parser.add_argument("--report", default="canary-report.json", metavar="FILE", help="where to write the JSON report")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from(ns: argparse.Namespace) -> CanaryConfig:
    return CanaryConfig(
        base_url=ns.base_url, keys=load_keys(ns.keys), model=ns.model, num_requests=ns.requests,
        concurrency=ns.concurrency, oversized_fraction=ns.oversized_fraction, abort_fraction=ns.abort_fraction,
        n_fraction=ns.n_fraction, logprobs_fraction=ns.logprobs_fraction,
        prompt_logprobs_fraction=ns.prompt_logprobs_fraction, echo_fraction=ns.echo_fraction,
        tools_fraction=ns.tools_fraction, pressure_requests=ns.pressure_requests,
        pressure_max_tokens=ns.pressure_max_tokens,
        max_context=ns.max_context, seed=ns.seed, max_tokens=ns.max_tokens, admin_key=ns.admin_key,
        timeout_s=ns.timeout, drain_timeout_s=ns.drain_timeout, report_path=ns.report,
    )


def cmd_canary(ns: argparse.Namespace) -> int:
    from kvseal.canary.report import summary_table, write_report
    from kvseal.canary.session import run_canary

    config = config_from(ns)
    if config.report_path:
        check_output_file(config.report_path, "--report")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the summary
    report = run_canary(config, show_progress=False if ns.no_progress else None)
    if config.report_path:
        write_report(report, config.report_path)
    print(summary_table(report))
    if config.report_path:
        print(f"report: {config.report_path}", file=sys.stderr)
    return 0 if report["verdict"]["passed"] else 1
