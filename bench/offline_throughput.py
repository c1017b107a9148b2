"""Offline throughput: kvseal against Hugging Face transformers' batched generate, same run.

Both load the same weights (the default SmolLM2-135M-Instruct GGUF, dequantized), use the
same dtype and thread count, and produce exactly --output-len tokens for each of
--num-prompts prompts of --prompt-len tokens (EOS ignored on both sides). Also measures
single-stream decode speed (one prompt) for both. Each engine runs in its own fresh process,
alternating (kvseal, transformers, kvseal, ...) so drift hits both; medians and ratios are
printed as one JSON object.

    python bench/offline_throughput.py                   # 64 x 256 prompt tokens, 128 out
    python bench/offline_throughput.py --num-prompts 8   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from kvseal import LLM, SamplingParams
from kvseal.models.loader import default_model_path

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or "
         "river mountain city garden music science history letter window morning").split()


def make_prompts(tokenizer: Any, num_prompts: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        text = " ".join(rng.choice(WORDS) for _ in range(prompt_len * 2))
        prompts.append(list(tokenizer.encode(text, add_special_tokens=False))[:prompt_len])
    return prompts


def run_kvseal(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.token_ids) for o in outputs)


def run_transformers(model: Any, prompts: list[list[int]], output_len: int, pad_id: int) -> tuple[float, int]:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    return elapsed, int(out[:, ids.shape[1]:].numel())


def measure(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one engine in this process: batch throughput and single-stream decode speed."""
    max_model_len = args.prompt_len + args.output_len
    llm = LLM(dtype=args.dtype, max_model_len=max_model_len,
              kv_cache_tokens=args.num_prompts * max_model_len, max_num_batched_tokens=2048)
    prompts = make_prompts(llm.get_tokenizer(), args.num_prompts, args.prompt_len, args.seed)
    if engine == "kvseal":
        def runner(p: list[list[int]], n: int) -> tuple[float, int]:
            return run_kvseal(llm, p, n)
    else:
        from transformers import AutoModelForCausalLM

        path = default_model_path()
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=getattr(torch, args.dtype)).eval()
        pad_id = llm.get_tokenizer().eos_token_id
        del llm

        def runner(p: list[list[int]], n: int) -> tuple[float, int]:
            return run_transformers(hf, p, n, pad_id)
    # Warm-up on the full workload: oneDNN compiles kernels per shape on first use, and
    # whichever engine ran first in a process would otherwise pay for both.
    runner(prompts, args.output_len)
    runner(prompts[:1], args.output_len)
    elapsed, tokens = runner(prompts, args.output_len)
    single_s, single_tokens = runner(prompts[:1], args.output_len)
    return {"batch_s": round(elapsed, 2), "output_tokens": tokens, "throughput_tok_s": round(tokens / elapsed, 1),
            "single_stream_tok_s": round(single_tokens / single_s, 1)}


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Alternate kvseal and transformers in fresh processes; report medians and ratios."""
    runs: dict[str, list[dict[str, Any]]] = {"kvseal": [], "transformers": []}
    for _ in range(args.repeats):
        for engine in runs:
            cmd = [sys.executable, __file__, "--engine", engine, *sys.argv[1:]]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[engine].append(json.loads(out))
    med = {e: {k: statistics.median(r[k] for r in rs) for k in ("throughput_tok_s", "single_stream_tok_s")}
           for e, rs in runs.items()}
    return {
        "config": {k: v for k, v in vars(args).items() if k != "engine"},
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} threads, torch {torch.__version__}",
        "runs": runs, "median": med,
        "throughput_ratio": round(med["kvseal"]["throughput_tok_s"] / med["transformers"]["throughput_tok_s"], 2),
        "single_stream_ratio": round(med["kvseal"]["single_stream_tok_s"]
                                     / med["transformers"]["single_stream_tok_s"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs of each engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", choices=["kvseal", "transformers"], help="run one side only (internal)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = measure(args.engine, args) if args.engine else compare(args)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
