"""Where the engine's time goes, step by step: the engine alone (no server) runs a closed loop
at one concurrency, and every forward is timed and filed by its kind (decode rows only, or a
step with prefill tokens). `--output-len 1` makes every step a prefill step.

    python bench/step_trace.py --concurrency 32 --rounds 2
    python bench/step_trace.py --concurrency 32 --rounds 3 --output-len 1
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from typing import Any

from engine_speed import run_concurrency  # bench/ is on the path when this file runs

from kvseal.llm import LLM
from kvseal.types import ForwardBatch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="requests = rounds x concurrency")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    warm_up_len = 8  # output tokens of the warm-up requests
    c, length = args.concurrency, args.prompt_len + max(args.output_len, warm_up_len)
    llm = LLM(model=None, dtype="auto", max_model_len=length, max_num_seqs=c, kv_cache_tokens=c * length)
    runner = llm.engine.runner
    steps: list[tuple[int, int, float]] = []  # (decode rows, prefill tokens, seconds)
    plain_run = runner.run

    def timed_run(batch: ForwardBatch) -> Any:
        start = time.perf_counter()
        out = plain_run(batch)
        lens = [int(n) for n in batch.query_lens]
        steps.append((sum(n == 1 for n in lens), sum(n for n in lens if n > 1), time.perf_counter() - start))
        return out

    runner.run = timed_run  # type: ignore[method-assign]
    run_concurrency(llm, min(4, c), min(4, c), args.prompt_len, warm_up_len, 1)
    steps.clear()
    result = run_concurrency(llm, c, args.rounds * c, args.prompt_len, args.output_len, 0)
    kinds: dict[str, list[float]] = collections.defaultdict(list)
    for rows, prefill, seconds in steps:
        width = args.prompt_len  # prefill steps filed by how many whole prompts' worth they carry
        kinds[f"decode {rows} rows" if prefill == 0 else f"prefill {prefill // width * width}+ tokens"].append(seconds)
    result["steps"] = {kind: {"steps": len(t), "seconds": round(sum(t), 2),
                              "ms_per_step": round(1000 * sum(t) / len(t), 1)} for kind, t in sorted(kinds.items())}
    result["forward_seconds"] = round(sum(s for _, _, s in steps), 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
