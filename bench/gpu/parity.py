"""Greedy parity of kvseal's engine against transformers on the same device and weights: the
tiny llama/qwen2/qwen3 of the tests (float32) and a 1B-class random-weight Llama (float32 here
too, so that a token differs only by a real bug, not a bf16 near-tie). Writes parity.json."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from common import Pair, engine_for, environment, random_pair, shape_config, write_json
from tiny_models import CONFIGS

from kvseal.types import SamplingParams

PROMPT_LENS = (7, 33, 64, 100)


def hf_greedy(hf: Any, prompt: list[int], num_tokens: int, device: str) -> list[int]:
    """transformers' greedy continuation, one forward per token over its own KV cache."""
    ids = torch.tensor([prompt], device=device)
    tokens: list[int] = []
    with torch.inference_mode():
        out = hf(ids, use_cache=True)
        for _ in range(num_tokens):
            token = out.logits[:, -1].float().argmax(-1)
            tokens.append(int(token))
            out = hf(token[:, None], past_key_values=out.past_key_values, use_cache=True)
    return tokens


def compare(name: str, pair: Pair, device: str, num_tokens: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    vocab = pair.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    engine = engine_for(pair, device, next(pair.hf.parameters()).dtype, kv_cache_tokens=4096, page_size=16,
                        max_model_len=min(512, pair.config.max_position_embeddings), max_num_batched_tokens=256)
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    ours: dict[str, list[int]] = {}
    while engine.has_unfinished():
        ours |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    engine.check_integrity()
    rows = []
    for i, prompt in enumerate(prompts):
        theirs = hf_greedy(pair.hf, prompt, num_tokens, device)
        got = ours[f"p{i}"]
        first = next((j for j, (a, b) in enumerate(zip(got, theirs)) if a != b), None)
        rows.append({"prompt_len": len(prompt), "equal": got == theirs, "first_difference": first})
    del engine
    return {"model": name, "all_equal": all(r["equal"] for r in rows), "prompts": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dry-run", action="store_true", help="tiny models only, few tokens")
    ns = parser.parse_args()
    results, started = [], time.monotonic()
    num_tokens = 8 if ns.dry_run else 32
    for arch in ("llama", "qwen2", "qwen3"):
        results.append(compare(f"tiny-{arch}", random_pair(CONFIGS[arch](), ns.device, torch.float32), ns.device,
                               num_tokens))
    if not ns.dry_run:
        pair = random_pair(shape_config("llama-1b"), ns.device, torch.float32)
        results.append(compare("llama-1b-shaped (random, float32)", pair, ns.device, num_tokens))
        del pair
    write_json("parity.json", {"environment": environment(), "device": ns.device, "tokens": num_tokens,
                               "all_equal": all(r["all_equal"] for r in results), "results": results,
                               "seconds": round(time.monotonic() - started, 1)})


if __name__ == "__main__":
    main()
