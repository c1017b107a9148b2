"""What page hygiene costs: output throughput of `--kv-scrub off|free|alloc` and `--check-kv`.

One engine per mode is loaded in this process (same weights, same pool size); the modes then
run the same workload in turn, round-robin, `--repeats` times, so each mode's figure comes from
the same minutes of the host as the others'. The workload is `bench/engine_speed.py`'s: `c`
requests in flight, random prompts, outputs forced to `--output-len` tokens, greedy. Reported:
each mode's median output tok/s and its ratio to `off` (scrub off, checked mode off) in the
same round.

    python bench/page_hygiene.py --concurrency 8 --repeats 3

With the prefix cache on (the default) a freed full page stays cached and `free` scrubs it at
eviction; `--no-prefix-caching` measures scrub-at-free as it was before the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_speed import run_concurrency  # noqa: E402

from kvseal import LLM  # noqa: E402

# mode name -> engine keyword arguments
MODES: dict[str, dict[str, Any]] = {
    "off": {"kv_scrub": "off"},
    "free": {"kv_scrub": "free"},
    "alloc": {"kv_scrub": "alloc"},
    "check_kv": {"kv_scrub": "off", "check_kv": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="requests per run = rounds x concurrency")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--json", default=None, help="write the raw results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    c, seq_len = args.concurrency, args.prompt_len + args.output_len
    # Room for a few rounds of requests, so that scrubbing (at free or at eviction) happens.
    engines = {mode: LLM(dtype=args.dtype, max_model_len=seq_len, kv_cache_tokens=2 * c * seq_len,
                         max_num_seqs=c, enable_prefix_caching=not args.no_prefix_caching, **kwargs)
               for mode, kwargs in MODES.items()}
    for llm in engines.values():
        run_concurrency(llm, min(4, c), min(4, c), args.prompt_len, 8, seed=1)  # warm-up
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    ratios: dict[str, list[float]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode, llm in engines.items():
            result = run_concurrency(llm, c, args.rounds * c, args.prompt_len, args.output_len, seed=100 + repeat)
            runs[mode].append(result)
            print(json.dumps({"repeat": repeat, "mode": mode, **result}), flush=True)
        for mode in MODES:
            ratios[mode].append(runs[mode][-1]["output_tok_s"] / runs["off"][-1]["output_tok_s"])
    summary = {mode: {"median_output_tok_s": statistics.median(r["output_tok_s"] for r in runs[mode]),
                      "median_ratio_to_off": round(statistics.median(ratios[mode]), 3),
                      "median_p99_ttft_ms": statistics.median(r["p99_ttft_ms"] for r in runs[mode])}
               for mode in MODES}
    report = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args),
              "threads": torch.get_num_threads(), "loadavg": os.getloadavg(), "summary": summary, "runs": runs}
    print(json.dumps({"summary": summary, "loadavg": report["loadavg"]}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
