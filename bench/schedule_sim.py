"""TTFT under the real scheduler, on a modelled clock: which request waits how long, and why.

Drives kvseal's own `LLMEngine` (scheduler, prefix cache, page pool: all real) over a tiny
random model, but charges every step the time a step of that shape takes on the benchmark
host instead of the tiny model's: `base + decode_s x decode rows + prefill_s x prefill tokens`
(defaults fitted to round 4's quiet-host engine numbers for SmolLM2-135M in float32 on 2 cores:
41 ms for a c=1 decode step, ~165 ms for 32 decode rows, ~3.8 s for a 2048-token prefill step).
A closed-loop client keeps `--concurrency` requests in flight, like `kvseal bench serve`: a
request that finishes is replaced at the end of the step that finished it.

What it isolates: the scheduling order and the arrival pattern. The step cost model is linear,
so it says nothing about which batch shapes the forward runs faster; time those with
`bench/engine_speed.py`.

    PYTHONPATH=$PWD python bench/schedule_sim.py --concurrency 32 --num-prompts 64
    PYTHONPATH=$PWD python bench/schedule_sim.py --concurrency 32 --num-prompts 64 --cached 16

`--cached K` first runs the first K prompts once (as `bench/peers/compare.sh` did before
round 6, when every concurrency reused seed 1's prompts and the c=1 run left them in the cache).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.tiny_models, from the checkout


@dataclass(frozen=True)
class StepCost:
    base_s: float
    decode_s: float
    prefill_s: float

    def of(self, num_decode_rows: int, num_prefill_tokens: int) -> float:
        return self.base_s + self.decode_s * num_decode_rows + self.prefill_s * num_prefill_tokens


def tiny_model(folder: Path, max_len: int) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.tiny_models import BOS_ID, EOS_ID, VOCAB_SIZE, make_tokenizer

    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_len,
                         eos_token_id=EOS_ID, bos_token_id=BOS_ID, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def simulate(engine: Any, prompts: list[list[int]], output_len: int, concurrency: int, cost: StepCost
             ) -> dict[str, Any]:
    from kvseal import SamplingParams

    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, ignore_eos=True, temperature=0)
    scheduler = engine.scheduler
    schedule = scheduler.schedule
    last_chunks: list[Any] = []

    def recording_schedule() -> Any:
        out = schedule()
        last_chunks[:] = out.chunks
        return out

    scheduler.schedule = recording_schedule
    clock, next_prompt = 0.0, 0
    sent: dict[str, float] = {}
    first: dict[str, float] = {}

    def submit() -> None:
        nonlocal next_prompt
        request_id = f"r{next_prompt}"
        engine.add_request(request_id, prompts[next_prompt], params)
        sent[request_id] = clock
        next_prompt += 1

    while next_prompt < min(concurrency, len(prompts)):
        submit()
    while engine.has_unfinished():
        outputs = engine.step()
        num_decode = sum(1 for c in last_chunks if c.num_new_tokens == 1 and c.request.num_output_tokens > 1)
        num_prefill = sum(c.num_new_tokens for c in last_chunks) - num_decode
        clock += cost.of(num_decode, num_prefill)
        for out in outputs:
            first.setdefault(out.request_id, clock)
            if out.finished and next_prompt < len(prompts):
                submit()
    scheduler.schedule = schedule
    ttfts = sorted(first[r] - sent[r] for r in sent)
    p99 = ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))]
    return {"seconds": round(clock, 1), "output_tok_s": round(len(prompts) * output_len / clock, 1),
            "mean_ttft_s": round(statistics.mean(ttfts), 2), "p99_ttft_s": round(p99, 2),
            "ttft_groups_s": _groups(ttfts)}


def _groups(ttfts: list[float]) -> list[tuple[float, int]]:
    """TTFTs rounded to 0.1 s with how many requests had each."""
    counts: dict[float, int] = {}
    for t in ttfts:
        counts[round(t, 1)] = counts.get(round(t, 1), 0) + 1
    return sorted(counts.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--cached", type=int, default=0, help="run the first K prompts once beforehand")
    parser.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[2048])
    parser.add_argument("--max-prefill-chunk-tokens", type=int, default=None)
    parser.add_argument("--base-s", type=float, default=0.037)
    parser.add_argument("--decode-s", type=float, default=0.004)
    parser.add_argument("--prefill-s", type=float, default=0.00184)
    args = parser.parse_args()

    from kvseal import LLM
    from tests.tiny_models import VOCAB_SIZE

    torch.set_num_threads(1)  # the clock is modelled: the tiny forward's own speed does not matter
    cost = StepCost(args.base_s, args.decode_s, args.prefill_s)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    max_len = args.input_len + args.output_len
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp), max_len)
        for budget in args.max_num_batched_tokens:
            llm = LLM(str(model), dtype="float32", max_model_len=max_len, page_size=16, max_num_seqs=256,
                      kv_cache_tokens=(args.concurrency + args.cached) * max_len + 16 * 64,
                      max_num_batched_tokens=budget, max_prefill_chunk_tokens=args.max_prefill_chunk_tokens)
            if args.cached:
                simulate(llm.engine, prompts[:args.cached], 1, args.cached, cost)
            result = simulate(llm.engine, prompts, args.output_len, args.concurrency, cost)
            print(json.dumps({"max_num_batched_tokens": budget, "cached": args.cached,
                              "concurrency": args.concurrency, **result}))


if __name__ == "__main__":
    main()
