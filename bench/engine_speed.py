"""Engine speed at fixed concurrency, offline: output tok/s and TTFT at c = 1, 8, 32.

The engine is driven in-process like a server at concurrency c: c requests are in flight,
and each one that finishes is replaced by the next until --rounds x c requests have run.
Prompts are random token ids (--prompt-len), outputs are forced to --output-len tokens
(min_tokens, ignore_eos, greedy), the same workload `kvseal bench serve` sends. There is no
HTTP or frontend process: this measures the engine step only.

Compare two trees by running this file with PYTHONPATH pointing at each, back to back,
alternating (the script imports `kvseal` from whatever PYTHONPATH names first):

    PYTHONPATH=/work/main python bench/engine_speed.py --label main
    PYTHONPATH=$PWD       python bench/engine_speed.py --label speed

Prints one JSON object per concurrency (output tok/s, mean/p99 TTFT) and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

import torch

import kvseal
from kvseal import LLM, SamplingParams

# (in, out) of a SmolLM2-135M-shaped stack of linears: 30 layers' q/k/v, o, gate/up and down
# (distinct weights, so nothing stays in cache) and the lm_head
SMOLLM2_LINEARS = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]


def random_prompts(vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size - 100) for _ in range(length)] for _ in range(num)]


def run_concurrency(llm: LLM, concurrency: int, num_requests: int, prompt_len: int, output_len: int,
                    seed: int) -> dict[str, Any]:
    engine = llm.engine
    prompts = random_prompts(engine.model_config.vocab_size, num_requests, prompt_len, seed)
    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, ignore_eos=True, temperature=0)
    submitted: dict[str, float] = {}
    first_token: dict[str, float] = {}
    num_output = 0
    next_prompt = 0
    start = time.perf_counter()

    def submit() -> None:
        nonlocal next_prompt
        request_id = f"c{concurrency}-{next_prompt}"
        engine.add_request(request_id, prompts[next_prompt], params)
        submitted[request_id] = time.perf_counter()
        next_prompt += 1

    while next_prompt < min(concurrency, num_requests):
        submit()
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids and out.request_id not in first_token:
                first_token[out.request_id] = now
            if out.finished:
                num_output += len(out.token_ids)
                if next_prompt < num_requests:
                    submit()
    elapsed = time.perf_counter() - start
    ttfts = sorted(first_token[r] - submitted[r] for r in submitted)
    p99 = ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))]
    return {"concurrency": concurrency, "requests": num_requests, "output_tokens": num_output,
            "seconds": round(elapsed, 3), "output_tok_s": round(num_output / elapsed, 2),
            "mean_ttft_ms": round(1000 * statistics.mean(ttfts), 1), "p99_ttft_ms": round(1000 * p99, 1)}


def bench_linears(rows_list: list[int], repeats: int) -> dict[str, Any]:
    """The float32 linears' kernels over a SmolLM2-135M-shaped stack (30 layers' q/k/v, o, gate/up,
    down with distinct weights, so nothing stays in cache, and the lm_head), alternating, best of
    `repeats`: ms per pass at each row count. `linear`: nn.Linear (MKL sgemm); `onednn`: oneDNN's
    packed weights (PackedLinear, the fallback without a compiler); `panels`: kvseal's C kernel
    over float32 panels (the default); `panels_bf16`: the same over bfloat16 panels
    (`--quantization bf16`)."""
    from kvseal.ops.native_build import BuildConfig, NativeBuildError
    from kvseal.ops.native_kernels import NativeKernels
    from kvseal.ops.native_linears import PanelLinear
    from kvseal.ops.torch_linears import PackedLinear

    plain = [torch.nn.Linear(k, n, bias=False) for k, n in SMOLLM2_LINEARS]
    kinds: dict[str, list[torch.nn.Module]] = {"linear": list(plain), "onednn": [PackedLinear(m) for m in plain]}
    try:
        kernels = NativeKernels.load(BuildConfig.from_environment())
        kinds["panels"] = [PanelLinear(m, kernels) for m in plain]
        kinds["panels_bf16"] = [PanelLinear(m, kernels, torch.bfloat16) for m in plain]
    except NativeBuildError:
        pass
    results = []
    for rows in rows_list:
        inputs = [torch.randn(rows, k) for k, _ in SMOLLM2_LINEARS]
        best = {name: float("inf") for name in kinds}
        for _ in range(repeats):
            for name, layers in kinds.items():
                start = time.perf_counter()
                with torch.inference_mode():
                    for layer, x in zip(layers, inputs):
                        layer(x)
                best[name] = min(best[name], 1000 * (time.perf_counter() - start))
        point: dict[str, Any] = {"rows": rows, **{f"{name}_ms": round(ms, 1) for name, ms in best.items()}}
        point.update({f"{name}_speedup_vs_onednn": round(best["onednn"] / best[name], 2) for name in best})
        results.append(point)
    return {"linears": results, "threads": torch.get_num_threads(), "loadavg": os.getloadavg()}


def bench_decode_attention(batch_sizes: list[int], context_len: int, repeats: int) -> dict[str, Any]:
    """Decode attention over SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64,
    16-token pages, scattered), ms per layer: this tree's decode attention (`in_place`: the
    native kernel where it builds, else V read in place by embedding bags) against the round-2
    formulation (K and V gathered, two matmuls),
    alternating, best of `repeats`. Outputs are compared too (max abs difference)."""
    results = [_time_decode_attention(b, context_len, repeats) for b in batch_sizes]
    return {"decode_attention": results, "threads": torch.get_num_threads(), "loadavg": os.getloadavg()}


def _time_decode_attention(batch_size: int, context_len: int, repeats: int) -> dict[str, Any]:
    from kvseal.kvcache.pool import KVPool
    from kvseal.models.attention import AttentionPlan
    from kvseal.ops import TorchOps, select_ops
    from kvseal.ops.torch_attention import GatheredRows
    from kvseal.types import ForwardBatch

    num_heads, page_size = 9, 16
    num_pages = -(-context_len // page_size)
    pool = KVPool(1, 2 * batch_size * num_pages, page_size, 3, 64, torch.float32)
    pool.k[0].normal_(), pool.v[0].normal_()
    tables = list(torch.randperm(pool.num_pages)[:batch_size * num_pages].view(batch_size, num_pages))
    batch = ForwardBatch(torch.zeros(batch_size, dtype=torch.long), torch.full((batch_size,), context_len - 1),
                         torch.zeros(batch_size, dtype=torch.long), [1] * batch_size, [context_len] * batch_size,
                         tables, torch.arange(batch_size))
    ops = select_ops()
    plan = AttentionPlan.build(batch, pool, num_heads, ops).decode
    gathered = AttentionPlan.build(batch, pool, num_heads, TorchOps()).decode
    assert plan is not None and gathered is not None and isinstance(gathered.plan, GatheredRows)
    rows = gathered.plan
    q = torch.randn(batch_size, num_heads, 64)

    # the round-2 formulation makes its own gather buffers
    buffers = [torch.empty(3, rows.pages.numel(), page_size, 64) for _ in range(2)]

    def gather_matmul() -> torch.Tensor:  # the formulation before round 3 (one gather buffer per step)
        for t, buffer in zip((pool.k, pool.v), buffers):
            torch.index_select(t[0], 1, rows.pages, out=buffer)
        k, v = (buffer.view(3, batch_size, -1, 64) for buffer in buffers)
        qg = q.view(batch_size, 3, 3, 64).transpose(0, 1)
        scores = torch.matmul(qg, k.transpose(2, 3)).mul_(64**-0.5).masked_fill_(rows.masked_out, float("-inf"))
        return torch.matmul(torch.softmax(scores, -1), v).transpose(0, 1).reshape(batch_size, num_heads, 64)

    def in_place() -> torch.Tensor:
        return ops.decode_attention(q, pool, 0, plan.plan)

    best = {"gather_matmul": float("inf"), "in_place": float("inf")}
    for _ in range(repeats):
        for name, fn in (("gather_matmul", gather_matmul), ("in_place", in_place)):
            start = time.perf_counter()
            for _ in range(20):
                fn()
            best[name] = min(best[name], 1000 * (time.perf_counter() - start) / 20)
    diff = float((gather_matmul() - in_place()).abs().max())
    return {"batch": batch_size, "context_len": context_len, **{k: round(v, 3) for k, v in best.items()},
            "speedup": round(best["gather_matmul"] / best["in_place"], 2), "max_abs_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=2, help="requests per concurrency = rounds x c")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none", help="none, int8 or bf16 (weight-only)")
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: the default model)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: prompt + output length (`kvseal serve` uses the model's, up to 2048 here)")
    parser.add_argument("--kv-cache-memory", default=None,
                        help="size the KV pool like `kvseal serve` (e.g. 2GiB), not max c x (prompt + output)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--page-size", type=int, default=16, help="KV page size in tokens (`kvseal serve --page-size`)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--linears", type=int, nargs="*", default=None, metavar="ROWS",
                        help="instead: time nn.Linear against the packed linears at these row counts")
    parser.add_argument("--decode-attention", type=int, nargs="*", default=None, metavar="BATCH",
                        help="instead: time decode attention (this tree vs K and V gathered) at these batch sizes")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.linears is not None:
        print(json.dumps(bench_linears(args.linears or [1, 8, 32, 256], repeats=4)))
        return
    if args.decode_attention is not None:
        sizes = args.decode_attention or [1, 8, 32]
        print(json.dumps(bench_decode_attention(sizes, args.prompt_len + args.output_len // 2, repeats=7)))
        return
    started = time.perf_counter()
    max_c = max(args.concurrency)
    pool: dict[str, Any] = ({"kv_cache_memory": args.kv_cache_memory} if args.kv_cache_memory
                            else {"kv_cache_tokens": max_c * (args.prompt_len + args.output_len)})
    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization,
              max_model_len=args.max_model_len or args.prompt_len + args.output_len, max_num_seqs=max(max_c, 1),
              page_size=args.page_size, **pool)
    load_s = time.perf_counter() - started
    run_concurrency(llm, min(4, max_c), min(4, max_c), args.prompt_len, 8, args.seed + 1)  # warm-up
    results = {"label": args.label, "kvseal": os.path.dirname(kvseal.__file__),
               "dtype": str(llm.engine.runner.pool.k[0].dtype), "quantization": args.quantization,
               "threads": torch.get_num_threads(),
               "load_s": round(load_s, 2), "runs": []}
    for c in args.concurrency:
        num = args.rounds * c
        results["runs"].append(run_concurrency(llm, c, num, args.prompt_len, args.output_len, args.seed))
    results["loadavg"] = os.getloadavg()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
