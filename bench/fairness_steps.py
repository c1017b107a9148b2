"""Tenant fairness counted in engine steps and tokens, not time (machine-independent).

Tenant A has two 960-token prompts in prefill (one step done); tenant B then sends four
32-token prompts. Reported for B alone and with A's load: the most engine steps, and the most
tokens computed (all tenants, the step itself included), before one of B's requests gets its
first token. Tokens computed is the TTFT proxy: a CPU step's time grows with its tokens.
Sizes are issue 9's fairness workload scaled down by 8 for the tiny test model (budget 256).

Usage: PYTHONPATH=TREE python bench/fairness_steps.py [--max-prefill-chunk-tokens N]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).parents[1] / "tests"), str(Path(__file__).parents[1] / "tests" / "server")]

from tiny_server_model import make_server_model  # noqa: E402

from kvseal import LLM, SamplingParams  # noqa: E402


def measure(model: Path, engine_args: dict[str, Any], with_long: bool) -> dict[str, int]:
    engine = LLM(str(model), **engine_args).engine
    step_tokens: list[int] = []
    schedule = engine.scheduler.schedule

    def counting() -> Any:
        out = schedule()
        step_tokens.append(sum(c.num_new_tokens for c in out.chunks))
        return out

    engine.scheduler.schedule = counting
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    if with_long:
        for i in range(2):
            engine.add_request(f"long{i}", [3 + (7 * i + j) % 500 for j in range(960)], params, tenant="A")
        engine.step()
    start = len(step_tokens)
    for i in range(4):
        engine.add_request(f"short{i}", [10 + (i + j) % 400 for j in range(32)], params, tenant="B")
    first: dict[str, tuple[int, int]] = {}
    for _ in range(1000):
        for out in engine.step():
            if out.request_id.startswith("short") and out.request_id not in first:
                first[out.request_id] = (len(step_tokens) - start, sum(step_tokens[start:]))
        if len(first) == 4:
            break
    return {"max_steps_to_first_token": max(s for s, _ in first.values()),
            "max_tokens_computed_before_first_token": max(t for _, t in first.values())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-prefill-chunk-tokens", type=int, default=None)
    ns = parser.parse_args()
    args: dict[str, Any] = dict(kv_cache_tokens=8192, page_size=16, max_num_batched_tokens=256,
                                dtype="float32", max_model_len=1024)
    if ns.max_prefill_chunk_tokens is not None:
        args["max_prefill_chunk_tokens"] = ns.max_prefill_chunk_tokens
    with tempfile.TemporaryDirectory() as tmp:
        model = make_server_model(Path(tmp) / "model")
        print(json.dumps({"engine_args": args, "alone": measure(model, args, False),
                          "with_long": measure(model, args, True)}))


if __name__ == "__main__":
    main()
