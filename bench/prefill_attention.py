"""Fresh-prefill attention: the native kernel against gathered q/k/v + causal SDPA, one process.

One step prefills `--prompts` prompts of `--prompt-tokens` random tokens each (default 8 x 256:
one 2,048-token step, the default budget) and samples one token. The two variants alternate
round by round (the order flips every round) in the same engine: "sdpa" runs fresh chunks on
SDPA (`NativeOps.fresh_kernel_dtype` patched to None), "native" on the kernel wherever it is
built (also where the engine would pick SDPA: bfloat16 on AMX). Per step: the whole step's time
and the time inside `paged_attention` (every layer, all paths). Reported: medians and minima per
variant, and the ratio of medians. The first round is a warm-up (not counted) and sends the same
prompts to both variants, whose sampled tokens must agree.

Usage: PYTHONPATH=TREE python bench/prefill_attention.py [--model DIR_OR_GGUF] [--rounds 7] [--dtype bfloat16]
Timings on a shared host are noisy: compare the variants within one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).parents[1])]

import kvseal.models.llama as llama  # noqa: E402
from kvseal import LLM, SamplingParams  # noqa: E402

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
VARIANTS = ("sdpa", "native")


class AttentionClock:
    """Seconds spent inside `llama.paged_attention` since the last `reset`."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._inner: Callable[..., Any] = llama.paged_attention

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._inner(*args)
        finally:
            self.total_s += time.perf_counter() - start

    def reset(self) -> None:
        self.total_s = 0.0


@contextlib.contextmanager
def variant(llm: LLM, name: str) -> Iterator[None]:
    """The engine's native ops with the prefill kernel wherever it is built ("native", also where
    the engine would pick SDPA), or with fresh chunks always on SDPA ("sdpa")."""
    ops = llm.engine.ops
    if ops.name != "native":
        raise SystemExit("the native kernels did not build here (see the log)")
    ops.sdpa_leads_fresh_prefill = lambda *args: False  # type: ignore[attr-defined]
    if name == "sdpa":
        ops.fresh_kernel_dtype = lambda *args: None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for patched in ("sdpa_leads_fresh_prefill", "fresh_kernel_dtype"):
            vars(ops).pop(patched, None)


def one_step(llm: LLM, prompts: list[list[int]], tag: str, clock: AttentionClock) -> tuple[float, float, list[int]]:
    """Prefill `prompts` in one step; returns (step_s, attention_s, the sampled tokens)."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, ONE_TOKEN)
    clock.reset()
    start = time.perf_counter()
    outputs = engine.step()
    step_s = time.perf_counter() - start
    if engine.has_unfinished():
        raise RuntimeError("the prompts did not fit one step: lower --prompts or --prompt-tokens")
    tokens = {o.request_id: o.token_ids[-1] for o in outputs}
    return step_s, clock.total_s, [tokens[f"{tag}-{i}"] for i in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: the default model)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (the model's and the pool's)")
    args = parser.parse_args()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, kv_cache_memory="2GiB")
    clock = AttentionClock()
    llama.paged_attention = clock
    rng = random.Random(0)
    draw = lambda: [[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]  # noqa: E731
    warm = draw()
    sampled = {}
    for name in VARIANTS:
        with variant(llm, name):
            sampled[name] = one_step(llm, warm, f"warm-{name}", clock)[2]
    if sampled["sdpa"] != sampled["native"]:
        raise SystemExit(f"the variants sampled different tokens: {sampled}")
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        for name in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            with variant(llm, name):
                step_s, attention_s, _ = one_step(llm, draw(), f"r{r}-{name}", clock)
            times[name].append((step_s, attention_s))
            print(f"round {r} {name:6s} step {step_s * 1e3:7.1f} ms  attention {attention_s * 1e3:6.1f} ms", flush=True)
    report(times)


def report(times: dict[str, list[tuple[float, float]]]) -> None:
    medians = {}
    for name, rows in times.items():
        steps, attns = [s for s, _ in rows], [a for _, a in rows]
        medians[name] = (statistics.median(steps), statistics.median(attns))
        print(f"{name:6s} step median {medians[name][0] * 1e3:7.1f} ms (min {min(steps) * 1e3:7.1f})  "
              f"attention median {medians[name][1] * 1e3:6.1f} ms (min {min(attns) * 1e3:6.1f})")
    old, new = medians["sdpa"], medians["native"]
    print(f"native / sdpa: step {new[0] / old[0]:.3f}, attention {new[1] / old[1]:.3f} "
          f"(attention saved {(old[1] - new[1]) * 1e3:.0f} ms per step)")


if __name__ == "__main__":
    main()
