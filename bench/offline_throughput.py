"""Offline throughput: kvseal against Hugging Face transformers' batched generate, same run.

Both load the same weights (the default SmolLM2-135M-Instruct GGUF, dequantized), use the
same dtype and thread count, and produce exactly --output-len tokens for each of
--num-prompts prompts of --prompt-len tokens (EOS ignored on both sides). Also measures
single-stream decode speed (one prompt) for both. Each engine runs in its own fresh process,
alternating (kvseal, transformers, kvseal, ...) so drift hits both; medians and ratios are
printed as one JSON object.

    python bench/offline_throughput.py                   # 64 x 256 prompt tokens, 128 out
    python bench/offline_throughput.py --num-prompts 8   # quicker

`--kv-check-ab N` measures instead what the always-on KV coverage check (I3/I4) costs: one
process, one engine, a full warm-up, then N pairs of runs of the same workload alternating
with the check on (A) and with it switched off by the test-only fault BYPASS_KV_CHECKS (B),
A B B A A B ... so that drift hits both alike. It also times the check itself and the per-layer
write records inside every A run, which is a steadier figure on a noisy machine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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

import kvseal.engine.engine as engine_module
from kvseal import LLM, SamplingParams
from kvseal._testing.faults import Fault, inject
from kvseal.kvcache.records import WriteRecords
from kvseal.model_files import default_model_path

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or "
         "river mountain city garden music science history letter window morning").split()


def make_prompts(tokenizer: Any, num_prompts: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        text = " ".join(rng.choice(WORDS) for _ in range(prompt_len * 2))
        prompts.append(list(tokenizer.encode(text, add_special_tokens=False))[:prompt_len])
    return prompts


def run_kvseal(llm: LLM, prompts: list[list[int]], output_len: int,
               clock: Any = time.perf_counter) -> tuple[float, int]:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = clock()
    outputs = llm.generate(prompts, params)
    elapsed = clock() - start
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


class _Timed:
    """Wrap a function and add up the CPU seconds this process spent in it (bench only)."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.total_s = fn, 0.0

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return functools.partial(self, obj) if obj is not None else self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total_s += time.process_time() - start


def kv_check_ab(args: argparse.Namespace) -> dict[str, Any]:
    """Throughput with the always-on KV check (A) vs. BYPASS_KV_CHECKS (B), interleaved.

    Throughput is reported per wall-clock second and per CPU second of this process: on a
    shared machine the second is far steadier (the wall clock also counts time the process
    waited for a core)."""
    max_model_len = args.prompt_len + args.output_len
    llm = LLM(dtype=args.dtype, max_model_len=max_model_len,
              kv_cache_tokens=args.num_prompts * max_model_len, max_num_batched_tokens=2048)
    prompts = make_prompts(llm.get_tokenizer(), args.num_prompts, args.prompt_len, args.seed)
    check = _Timed(engine_module.check_forward)
    engine_module.check_forward = check  # type: ignore[assignment]
    record = _Timed(WriteRecords.on_layer_write)
    WriteRecords.on_layer_write = record  # type: ignore[method-assign]
    plan = _Timed(WriteRecords.plan)
    WriteRecords.plan = plan  # type: ignore[method-assign]
    run_kvseal(llm, prompts, args.output_len)  # warm-up
    runs: dict[str, dict[str, list[float]]] = {"check": {"wall": [], "cpu": []}, "bypass": {"wall": [], "cpu": []}}
    check_share: list[float] = []
    for i in range(2 * args.kv_check_ab):
        variant = "check" if i % 4 in (0, 3) else "bypass"  # A B B A A B B A ...
        check.total_s = record.total_s = plan.total_s = 0.0
        wall, cpu = time.perf_counter(), time.process_time()
        with inject(Fault.BYPASS_KV_CHECKS) if variant == "bypass" else contextlib.nullcontext():
            _, tokens = run_kvseal(llm, prompts, args.output_len)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if variant == "check":
            check_share.append((check.total_s + record.total_s + plan.total_s) / cpu)
        runs[variant]["wall"].append(round(tokens / wall, 2))
        runs[variant]["cpu"].append(round(tokens / cpu, 2))
        print(f"{variant}: {tokens / wall:.2f} tok/s wall, {tokens / cpu:.2f} tok/s per CPU second",
              file=sys.stderr, flush=True)
    med = {v: {clock: statistics.median(r) for clock, r in rs.items()} for v, rs in runs.items()}
    return {
        "config": {k: v for k, v in vars(args).items() if k != "engine"},
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} threads, torch {torch.__version__}",
        "throughput_tok_s": runs, "median_tok_s": med,
        "ratio_check_over_bypass": {clock: round(med["check"][clock] / med["bypass"][clock], 4)
                                    for clock in ("wall", "cpu")},
        "check_and_records_share_of_time": {"median": round(statistics.median(check_share), 5),
                                            "min": round(min(check_share), 5), "max": round(max(check_share), 5)},
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
    parser.add_argument("--kv-check-ab", type=int, default=0, metavar="N",
                        help="instead: N interleaved pairs, always-on KV check vs. BYPASS_KV_CHECKS")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.kv_check_ab:
        result = kv_check_ab(args)
    else:
        result = measure(args.engine, args) if args.engine else compare(args)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
