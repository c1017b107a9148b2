"""Two trees' engines, A/B in short alternating bursts: decode steps at concurrency c, prefill
steps of long prompts, and served-style waves of prompts, the default model (or --model), one
engine per tree in its own process.

`bench/engine_speed.py` runs one tree at a time for tens of seconds; on a host whose load swings
by several times from minute to minute (other jobs), two such runs are not comparable. Here
each tree's engine is loaded once, in its own process (`kvseal` imported from that tree), and
the two take turns (ABBA...) at bursts of a second or two, so adjacent bursts see about the same
host; the figure of merit is the median of the B/A ratios of adjacent bursts: of wall time, and
of the process's CPU time (with --threads 1 the work itself, which other jobs move far less than
the wall time). Both engines run the same requests in the same order, so burst i is the same
work in each: a decode burst is --steps engine steps of c requests decoding (every request forced
to run long), a prefill burst is --prompts fresh prompts of --prompt-len tokens prefilled in one
step and one token sampled (prefix caching off, no request decoding), and a wave burst is
--prompts prompts arriving at once, timed until every one has its first token, each decoding
from its first token on, as a served wave runs them (with --budget 2048, the server's default
step budget, the wave's later steps carry the decode rows of its earlier prompts, and a prompt
the budget splits continues in the next step). Greedy tokens are compared (equal engines give
equal tokens).

    python bench/engine_ab.py --a /path/to/base --b . --dtype bfloat16 --bursts 16

The same tree under two environments (an OpenMP setting, say) is an A/B too, and
--competitor-duty runs a third process beside them that burns that share of one core in short
bursts (--competitor-period-ms), the way a load generator or a frontend takes CPU from a
2-core engine: it tells how much a step loses to a preempted thread.

    python bench/engine_ab.py --a . --b . --env-b OMP_WAIT_POLICY=PASSIVE --competitor-duty 0.25
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def worker(args: argparse.Namespace) -> None:
    """One tree's engine: answers 'decode' and 'prefill' lines on stdin with one JSON line each."""
    import torch

    from kvseal import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    context = args.prompt_len + args.steps * (args.bursts + 2) + 8
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=max(context, args.prompt_len + 8),
              kv_cache_tokens=max(args.concurrency * context, args.prompts * (args.prompt_len + 8)) + 1024,
              max_num_seqs=max(args.concurrency, args.prompts),
              max_num_batched_tokens=args.budget or max(2048, args.prompts * args.prompt_len),
              max_prefill_chunk_tokens=max(2048, args.prompt_len), enable_prefix_caching=False)
    engine, rng = llm.engine, random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    long_run = SamplingParams(max_tokens=context - args.prompt_len - 8, ignore_eos=True, temperature=0)
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    decoding = {f"d{i}" for i in range(args.concurrency)}
    for request_id in sorted(decoding):  # prefilled before the first burst
        engine.add_request(request_id, [rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)], long_run)
    waiting = set(decoding)
    while waiting:
        waiting -= {o.request_id for o in engine.step() if o.new_token_ids}
    prefills = 0
    print(json.dumps({"ready": True, "kvseal": os.path.dirname(str(__import__("kvseal").__file__))}), flush=True)
    for line in sys.stdin:
        command, tokens = line.strip(), []
        start, cpu = time.perf_counter(), time.process_time()
        if command == "decode":
            for _ in range(args.steps):
                tokens += [o.new_token_ids[-1] for o in engine.step() if o.new_token_ids]
        elif command == "prefill":  # with no request decoding (see "end-decode")
            pending = {f"p{prefills}-{i}" for i in range(args.prompts)}
            for request_id in sorted(pending):
                engine.add_request(request_id, [rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)], one)
            prefills += 1
            while pending:
                for out in engine.step():
                    tokens += out.new_token_ids[-1:]
                    if out.finished:
                        pending.discard(out.request_id)
        elif command == "wave":  # with no request decoding: until every prompt has its first token
            firsts: dict[str, int] = {}
            wave = [f"w{prefills}-{i}" for i in range(args.prompts)]
            for request_id in wave:
                engine.add_request(request_id, [rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)],
                                   long_run)
            prefills += 1
            while len(firsts) < len(wave):
                for out in engine.step():
                    if out.new_token_ids:
                        firsts.setdefault(out.request_id, out.new_token_ids[0])
            tokens = [firsts[request_id] for request_id in wave]
        else:  # "end-decode": the decoding requests end, untimed
            for request_id in decoding:
                engine.abort(request_id)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        if command == "wave":  # the wave's requests end, untimed
            for request_id in wave:
                engine.abort(request_id)
        print(json.dumps({"s": seconds, "cpu_s": cpu_seconds, "tokens": tokens}), flush=True)


def start(tree: Path, argv: list[str], extra_env: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(tree), **dict(kv.split("=", 1) for kv in extra_env)}
    proc = subprocess.Popen([sys.executable, __file__, "--worker", *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd="/")
    return proc


def compete(duty: float, period_ms: float) -> None:
    """Burn `duty` of one core: busy for duty x period, asleep for the rest, until killed."""
    busy_s, idle_s = duty * period_ms / 1000, (1 - duty) * period_ms / 1000
    while True:
        until = time.perf_counter() + busy_s
        while time.perf_counter() < until:
            pass
        time.sleep(idle_s)


def ask(proc: subprocess.Popen[str], what: str) -> dict[str, Any]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(what + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def summary(bursts: dict[str, list[dict[str, Any]]], key: str) -> dict[str, Any]:
    """Medians of each side's `key` (wall seconds, or the process's CPU seconds: with --threads 1
    the work itself, little moved by other jobs), and of the b/a ratios of adjacent bursts."""
    a, b = ([burst[key] for burst in bursts[name]] for name in ("a", "b"))
    ratios = sorted(y / x for x, y in zip(a, b))
    return {f"{key}_a_median": round(statistics.median(a), 3), f"{key}_b_median": round(statistics.median(b), 3),
            f"{key}_b_over_a_median": round(statistics.median(ratios), 3),
            f"{key}_b_over_a_quartiles": [round(ratios[len(ratios) // 4], 3), round(ratios[3 * len(ratios) // 4], 3)],
            f"{key}_a": [round(t, 3) for t in a], f"{key}_b": [round(t, 3) for t in b]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--a", type=Path, help="baseline tree")
    parser.add_argument("--b", type=Path, default=Path("."), help="tree under test (default: here)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", type=int, default=32, help="decoding requests")
    parser.add_argument("--steps", type=int, default=8, help="engine steps per decode burst")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per prefill burst")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--bursts", type=int, default=16, help="bursts of each kind per tree")
    parser.add_argument("--budget", type=int, default=0,
                        help="max_num_batched_tokens (default: a prefill burst's prompts in one step, at least 2048)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--env-a", action="append", default=[], metavar="KEY=VALUE", help="more environment for A")
    parser.add_argument("--env-b", action="append", default=[], metavar="KEY=VALUE", help="more environment for B")
    parser.add_argument("--kinds", default="decode,prefill",
                        help="which bursts, in order (default decode,prefill; decode cannot follow prefill, which "
                             "ends the decoding requests)")
    parser.add_argument("--competitor-duty", type=float, default=0.0,
                        help="share of one core a third process burns while the bursts run (default 0: none)")
    parser.add_argument("--competitor-period-ms", type=float, default=40.0)
    parser.add_argument("--competitor", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    ends = [kinds.index(k) for k in ("prefill", "wave") if k in kinds]
    if any(k not in ("decode", "prefill", "wave") for k in kinds) or ("decode" in kinds and ends
                                                                       and kinds.index("decode") > min(ends)):
        parser.error("--kinds takes decode, prefill and/or wave, decode first: the others end the decoding requests")
    if args.worker:
        worker(args)
        return
    if args.competitor:
        compete(args.competitor_duty, args.competitor_period_ms)
        return
    argv = sys.argv[1:]
    procs = {"a": start(args.a.resolve(), argv, args.env_a), "b": start(args.b.resolve(), argv, args.env_b)}
    competitor = None
    try:
        for name, proc in procs.items():
            assert proc.stdout is not None
            ready = json.loads(proc.stdout.readline())
            print(json.dumps({name: ready["kvseal"]}), flush=True)
        if args.competitor_duty > 0:
            competitor = subprocess.Popen([sys.executable, __file__, "--competitor", *argv])
        for kind in args.kinds.split(","):
            if kind != "decode":
                for proc in procs.values():
                    ask(proc, "end-decode")
            bursts: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
            for burst in range(args.bursts):
                for name in ("a", "b") if burst % 2 == 0 else ("b", "a"):
                    bursts[name].append(ask(procs[name], kind))
            same = all(x["tokens"] == y["tokens"] for x, y in zip(bursts["a"], bursts["b"]))
            print(json.dumps({"kind": kind, **summary(bursts, "s"), **summary(bursts, "cpu_s"), "tokens_equal": same,
                              "loadavg": os.getloadavg()}), flush=True)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait(timeout=10)
        for proc in procs.values():
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
