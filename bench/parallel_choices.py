"""`n` choices of one prompt: the prompt prefilled once (the scheduler's wait on an in-flight
prefix) against once per choice (the scheduler before that wait, patched in here only).

Each trial draws a fresh random prompt of `--prompt-tokens` (so no trial hits another's cache),
then times one offline request with `n` choices, `--output-tokens` each, in both modes; the
modes alternate, first one then the other, so drift hits both alike. Reported: each mode's
wall times, the ratio of medians, and the prompt tokens each mode prefilled (from the choices'
cached-token counts).

Usage: PYTHONPATH=TREE python bench/parallel_choices.py [--model PATH] [--n 4] [--trials 5]
(default model: SmolLM2-135M GGUF).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).parents[1])]

from kvseal import LLM, SamplingParams  # noqa: E402
from kvseal.engine.scheduler import Scheduler  # noqa: E402
from kvseal.model_files import default_model_path  # noqa: E402


@contextlib.contextmanager
def prefilled_per_choice() -> Iterator[None]:
    """The scheduler as it was before the wait: every waiting request may start at once."""
    startable = Scheduler._startable
    Scheduler._startable = lambda self: list(self.waiting)  # type: ignore[method-assign]
    try:
        yield
    finally:
        Scheduler._startable = startable  # type: ignore[method-assign]


def run_once(llm: LLM, prompt: list[int], choices: list[SamplingParams]) -> tuple[float, int]:
    """(wall seconds, prompt tokens prefilled over all choices). The choices go in as the
    server sends them: one engine request each, all at once."""
    start = time.perf_counter()
    outs = llm.generate([prompt] * len(choices), choices)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(prompt) - out.num_cached_tokens for out in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2-135M GGUF)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the JSON result here too")
    args = parser.parse_args()

    llm = LLM(args.model or str(default_model_path()), dtype=args.dtype, kv_cache_memory="2GiB")
    vocab = llm.engine.model_config.vocab_size
    params = [SamplingParams(max_tokens=args.output_tokens, temperature=0.8, seed=i, ignore_eos=True)
              for i in range(args.n)]
    rng = random.Random(0)
    run_once(llm, [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)], params)  # warm-up
    times: dict[str, list[float]] = {"once": [], "per_choice": []}
    prefilled: dict[str, int] = {}
    for trial in range(args.trials):
        modes = ["once", "per_choice"] if trial % 2 == 0 else ["per_choice", "once"]
        for mode in modes:
            prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
            with prefilled_per_choice() if mode == "per_choice" else contextlib.nullcontext():
                elapsed, prefilled[mode] = run_once(llm, prompt, params)
            times[mode].append(elapsed)
    result: dict[str, Any] = {
        "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "n": args.n,
        "seconds": times, "prompt_tokens_prefilled": prefilled,
        "median_s": {mode: statistics.median(t) for mode, t in times.items()},
    }
    result["speedup"] = result["median_s"]["per_choice"] / result["median_s"]["once"]
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
