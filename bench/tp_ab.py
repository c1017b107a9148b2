"""Tensor parallelism on one host: TP=1 against TP=2, same workload, fresh processes, alternating.

The default model (SmolLM2-135M) in --dtype (default float32): batch throughput (--num-prompts prompts of
--prompt-len tokens, --output-len out, EOS ignored) and single-stream decode, for three
configurations: TP=1 with --threads torch threads, TP=1 with one thread, and TP=2 with
--threads / 2 threads per rank (the same cores as the first). On a CPU host TP adds two
all-reduces per layer over loopback gloo and splits already small matmuls: expect no speed-up
from TP itself; TP is for models that do not fit one device. On a host shared with other work,
one OpenMP thread per process avoids barrier stalls, which the second configuration isolates.

    python bench/tp_ab.py --rounds 2 --out bench/results/tp_ab.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

from kvseal import LLM, SamplingParams


def measure(tp: int, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    max_model_len = args.prompt_len + args.output_len
    llm = LLM(None, dtype=args.dtype, tensor_parallel_size=tp, num_threads=threads, max_model_len=max_model_len,
              kv_cache_tokens=args.num_prompts * max_model_len, max_num_batched_tokens=1024)
    try:
        prompts = [[(7 * i + 13 * j) % 40000 + 100 for j in range(args.prompt_len)] for i in range(args.num_prompts)]
        params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        batch_s = time.perf_counter() - start
        start = time.perf_counter()
        one = llm.generate([prompts[0]], params)[0]
        single_s = time.perf_counter() - start
    finally:
        llm.engine.close()
    num_tokens = sum(len(o.token_ids) for o in outs)
    return {"tp": tp, "threads_per_rank": threads, "batch_tokens_per_s": num_tokens / batch_s,
            "single_stream_tokens_per_s": len(one.token_ids) / single_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", nargs=2, type=int, help=argparse.SUPPRESS)  # tp, threads: one run in this process
    parser.add_argument("--out", help="also write the JSON result here")
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one[0], args.one[1], args)))
        return
    configs = [(1, args.threads), (1, 1), (2, max(1, args.threads // 2))]
    runs: dict[str, list[dict[str, Any]]] = {f"tp{tp}_threads{t}": [] for tp, t in configs}
    base = [sys.executable, __file__, "--num-prompts", str(args.num_prompts), "--prompt-len", str(args.prompt_len),
            "--output-len", str(args.output_len), "--threads", str(args.threads), "--dtype", args.dtype]
    for _ in range(args.rounds):
        for tp, threads in configs:
            out = subprocess.run([*base, "--one", str(tp), str(threads)], capture_output=True, text=True, check=True,
                                 timeout=1800)
            runs[f"tp{tp}_threads{threads}"].append(json.loads(out.stdout.strip().splitlines()[-1]))
    result = {"host": platform.processor() or platform.machine(), "workload": vars(args) | {"one": None},
              "runs": runs}
    for name, measured in runs.items():
        for key in ("batch_tokens_per_s", "single_stream_tokens_per_s"):
            result[f"{name}_{key}_median"] = statistics.median(r[key] for r in measured)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
