"""Tenant fairness counted in engine steps and work, not time (machine-independent).

Tenant A has two 960-token prompts in prefill (one step done); tenant B runs a closed loop like
`kvseal bench serve --fairness`: four 32-token prompts at once, each decoding 4 tokens; when they
have all finished, one engine step starts (the client's round trip) and B's next four arrive.
Reported for B alone and with A's load: the most engine steps, and the most work computed (all
tenants, in token-equivalents by the scheduler's `chunk_cost`: attention counted), from the
start of that in-between step until one of B's next requests gets its first token. Work is the
TTFT proxy: a CPU step's time grows with it. Sizes are issue 9's fairness workload scaled down
by 8 for the tiny test model (budget 256, fair share 32).

Usage: PYTHONPATH=$PWD python bench/fairness_steps.py [--max-prefill-chunk-tokens N] [--fair-share-tokens N]
(`--fair-share-tokens 1000000000`: the scheduler without fair shares)
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
from kvseal.engine.scheduler import chunk_cost  # noqa: E402


def measure(model: Path, engine_args: dict[str, Any], with_long: bool) -> dict[str, float]:
    engine = LLM(str(model), **engine_args).engine
    engine.scheduler.clock = lambda: 0.0  # steps are instants here: a tenant that just left still lingers
    k = engine.scheduler_config.attention_cost_context
    step_work: list[float] = []
    schedule = engine.scheduler.schedule

    def counting() -> Any:
        out = schedule()
        step_work.append(sum(chunk_cost(c.start_pos, c.num_new_tokens, k) for c in out.chunks))
        return out

    engine.scheduler.schedule = counting
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    if with_long:
        for i in range(2):
            engine.add_request(f"long{i}", [3 + (7 * i + j) % 500 for j in range(960)], params, tenant="A")
        engine.step()

    def short_round(name: str, first_token: int) -> None:  # prompts no earlier one begins with
        for i in range(4):
            engine.add_request(f"{name}{i}", [first_token + 40 * i + j for j in range(32)], params, tenant="B")

    short_round("prev", 10)
    for _ in range(1000):
        engine.step()
        if all(engine.find(f"prev{i}") is None for i in range(4)):
            break
    start = len(step_work)
    engine.step()  # starts before B's next prompts arrive
    short_round("short", 200)
    first: dict[str, tuple[int, float]] = {}
    for _ in range(1000):
        for out in engine.step():
            if out.request_id.startswith("short") and out.request_id not in first:
                first[out.request_id] = (len(step_work) - start, sum(step_work[start:]))
        if len(first) == 4:
            break
    return {"max_steps_to_first_token": max(s for s, _ in first.values()),
            "max_work_before_first_token": round(max(w for _, w in first.values()), 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-prefill-chunk-tokens", type=int, default=None)
    parser.add_argument("--fair-share-tokens", type=int, default=32)
    ns = parser.parse_args()
    args: dict[str, Any] = dict(kv_cache_tokens=8192, page_size=16, max_num_batched_tokens=256,
                                dtype="float32", max_model_len=1024, fair_share_tokens=ns.fair_share_tokens)
    if ns.max_prefill_chunk_tokens is not None:
        args["max_prefill_chunk_tokens"] = ns.max_prefill_chunk_tokens
    with tempfile.TemporaryDirectory() as tmp:
        model = make_server_model(Path(tmp) / "model")
        alone, loaded = measure(model, args, False), measure(model, args, True)
        ratio = loaded["max_work_before_first_token"] / alone["max_work_before_first_token"]
        print(json.dumps({"engine_args": args, "alone": alone, "with_long": loaded, "work_ratio": round(ratio, 2)}))


if __name__ == "__main__":
    main()
