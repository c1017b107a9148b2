"""Prefix cache: TTFT on a hit, and the cross-tenant timing side channel (issue 10).

1. Hit speed-up: time to first token (engine alone, one request at a time, offline) for a
   prompt of a `--prefix-tokens` shared system prompt plus a short distinct suffix, with the
   prefix cache off and on (warmed by one earlier request of the same tenant). Reported:
   both distributions and the ratio of medians, measured in the same run.
2. Side channel: can tenant B tell from its own TTFT whether tenant A sent a prefix? Each
   trial draws a fresh random prefix; in half of the trials (shuffled) A sends it first, then
   B sends the same prefix with its own suffix and B's TTFT is recorded. The two
   distributions of B's TTFT (A sent / A did not) are compared with a two-sided Mann-Whitney
   U test. The same trials are repeated on a deliberately broken build (the test-only fault
   DROP_CACHE_NAMESPACE with BYPASS_KV_CHECKS: keys without the namespace, as an engine
   without per-tenant namespacing) to show the test does detect a real channel.

Usage: PYTHONPATH=TREE python bench/prefix_cache.py [--model PATH] [--trials N] [--out FILE]
(default model: SmolLM2-135M GGUF). Timings on a shared host are noisy: ratios and rank tests
within one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).parents[1])]

from kvseal import LLM, SamplingParams  # noqa: E402
from kvseal._testing.faults import Fault, inject  # noqa: E402

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def ttft_s(engine: Any, request_id: str, prompt: list[int], tenant: str) -> tuple[float, int]:
    """Seconds from add_request to the step that returns the request's first token, and its
    cached tokens."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt, ONE_TOKEN, tenant=tenant)
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.token_ids:
                elapsed = time.perf_counter() - start
                while engine.has_unfinished():
                    engine.step()
                return elapsed, out.num_cached_tokens


def random_tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def hit_speedup(model: str | None, engine_args: dict[str, Any], prefix_len: int, trials: int,
                rng: random.Random) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, enabled in (("cache_off", False), ("cache_on_hit", True)):
        llm = LLM(model, enable_prefix_caching=enabled, **engine_args)
        vocab = llm.engine.model_config.vocab_size
        system = random_tokens(random.Random(1), vocab, prefix_len)
        ttft_s(llm.engine, "warm", system + random_tokens(rng, vocab, 16), "alice")  # warms kernels (and the cache)
        runs = [ttft_s(llm.engine, f"{name}{i}", system + random_tokens(rng, vocab, 16), "alice")
                for i in range(trials)]
        times = [t for t, _ in runs]
        results[name] = {"ttft_s": times, "median_s": statistics.median(times),
                         "cached_tokens": sorted({c for _, c in runs})}
    results["speedup_median"] = results["cache_off"]["median_s"] / results["cache_on_hit"]["median_s"]
    return results


def side_channel(model: str | None, engine_args: dict[str, Any], prefix_len: int, trials: int,
                 rng: random.Random) -> dict[str, Any]:
    """B's TTFT with and without A having sent the same prefix just before."""
    llm = LLM(model, **engine_args)
    engine, vocab = llm.engine, llm.engine.model_config.vocab_size
    ttft_s(engine, "warm", random_tokens(rng, vocab, prefix_len + 16), "carol")  # warms kernels
    conditions = [True, False] * (trials // 2)
    rng.shuffle(conditions)
    runs: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
    for i, a_sends in enumerate(conditions):
        prefix = random_tokens(rng, vocab, prefix_len)
        if a_sends:
            ttft_s(engine, f"a{i}", prefix + random_tokens(rng, vocab, 16), "alice")
        runs[a_sends].append(ttft_s(engine, f"b{i}", prefix + random_tokens(rng, vocab, 16), "bob"))
    sent, silent = ([t for t, _ in runs[c]] for c in (True, False))
    u, p = mann_whitney_u(sent, silent)
    return {"b_ttft_after_a_sent_s": sent, "b_ttft_a_silent_s": silent,
            "median_after_a_sent_s": statistics.median(sent), "median_a_silent_s": statistics.median(silent),
            "b_cached_tokens_after_a_sent": sorted({c for _, c in runs[True]}),
            "b_cached_tokens_a_silent": sorted({c for _, c in runs[False]}),
            "mann_whitney_u": u, "p_value": p}


def mann_whitney_u(x: list[float], y: list[float]) -> tuple[float, float]:
    """Two-sided Mann-Whitney U: scipy's if installed, else the normal approximation (ties averaged)."""
    try:
        from scipy.stats import mannwhitneyu
    except ImportError:
        return _mann_whitney_normal(x, y)
    result = mannwhitneyu(x, y, alternative="two-sided")
    return float(result.statistic), float(result.pvalue)


def _mann_whitney_normal(x: list[float], y: list[float]) -> tuple[float, float]:
    values = sorted((v, i) for i, v in enumerate(x + y))
    ranks = [0.0] * len(values)
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1][0] == values[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[values[k][1]] = (i + j) / 2 + 1
        i = j + 1
    n1, n2 = len(x), len(y)
    u = sum(ranks[:n1]) - n1 * (n1 + 1) / 2
    z = (u - n1 * n2 / 2) / math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12)
    return u, math.erfc(abs(z) / math.sqrt(2))


@contextlib.contextmanager
def faults(*switches: Fault) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for switch in switches:
            stack.enter_context(inject(switch))
        yield


def progress(name: str, section: dict[str, Any]) -> dict[str, Any]:
    """Each section on stderr as soon as it is measured (a slow host may stop the run early)."""
    print(json.dumps({name: section}), file=sys.stderr, flush=True)
    return section


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2-135M GGUF)")
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--trials", type=int, default=10, help="per distribution (side channel: per condition)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default=None, help="write the JSON result here too")
    ns = parser.parse_args()
    engine_args = dict(dtype=ns.dtype, max_model_len=ns.prefix_tokens + 64,
                       kv_cache_tokens=4 * (ns.prefix_tokens + 64), page_size=16)
    rng = random.Random(0)
    result: dict[str, Any] = {"prefix_tokens": ns.prefix_tokens, "trials": ns.trials,
                              "model": ns.model or "default (SmolLM2-135M GGUF)"}
    result["hit"] = progress("hit", hit_speedup(ns.model, engine_args, ns.prefix_tokens, ns.trials, rng))
    result["side_channel_namespaced"] = progress("side_channel_namespaced", side_channel(
        ns.model, engine_args, ns.prefix_tokens, 2 * ns.trials, rng))
    with faults(Fault.DROP_CACHE_NAMESPACE, Fault.BYPASS_KV_CHECKS):
        result["side_channel_broken_build"] = progress("side_channel_broken_build", side_channel(
            ns.model, engine_args, ns.prefix_tokens, 2 * ns.trials, rng))
    text = json.dumps(result, indent=1)
    print(text)
    if ns.out:
        Path(ns.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
