"""Throughput of kvseal's engine against transformers' batched `generate` on the same device and
random weights: fixed-length prompts, forced output length, several concurrencies. Also the
decode step time against the HBM roofline: (weight bytes + KV bytes read per step) / measured
device copy bandwidth. Writes throughput.json."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from common import Pair, engine_for, environment, random_pair, shape_config, write_json

from kvseal.engine.gpu_memory import model_bytes
from kvseal.types import SamplingParams


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, num_bytes: int) -> float:
    """Bytes per second a device-to-device copy moves (read + write), best of several."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def prompts_of(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=generator).tolist() for _ in range(num)]


def run_kvseal(pair: Pair, device: str, dtype: torch.dtype, prompts: list[list[int]], output_len: int,
               budget: int) -> dict[str, Any]:
    """All prompts at once through the engine; the wall time and every step's time."""
    engine = engine_for(pair, device, dtype, kv_cache_tokens=len(prompts) * (len(prompts[0]) + output_len) + 1024,
                        page_size=16, max_model_len=len(prompts[0]) + output_len + 16, max_num_seqs=len(prompts),
                        max_num_batched_tokens=budget, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    sync(device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    step_s: list[tuple[float, int]] = []  # (seconds, tokens produced)
    while engine.has_unfinished():
        t = time.perf_counter()
        outputs = engine.step()  # reads the sampled tokens back: the step's work is done
        step_s.append((time.perf_counter() - t, len(outputs)))
    wall = time.perf_counter() - start
    # decode-only steps: every request produced a token; the prefill steps come first
    decodes = [s for s, n in step_s if n == len(prompts)][1:]
    bytes_per_token = 2 * pair.config.num_layers * pair.config.num_kv_heads * pair.config.head_dim * \
        torch.empty((), dtype=dtype).element_size()
    engine.close()
    return {"wall_s": wall, "output_tokens_per_s": len(prompts) * output_len / wall, "num_steps": len(step_s),
            "decode_step_ms_median": 1000 * statistics.median(decodes) if decodes else None,
            "kv_bytes_per_token": bytes_per_token}


def run_hf(pair: Pair, device: str, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """transformers' batched greedy `generate` (equal prompt lengths: no padding), forced length."""
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        pair.hf.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm up
        sync(device)
        start = time.perf_counter()
        out = pair.hf.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
        sync(device)
    wall = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + output_len
    return {"wall_s": wall, "output_tokens_per_s": len(prompts) * output_len / wall}


def bench_shape(shape: str, device: str, dtype: torch.dtype, concurrencies: list[int], prompt_len: int,
                output_len: int, bandwidth: float, budget: int) -> dict[str, Any]:
    pair = random_pair(shape_config(shape, max_positions=prompt_len + output_len + 64), device, dtype)
    weights = model_bytes(pair.loaded.model)
    run_kvseal(pair, device, dtype, prompts_of(2, prompt_len, pair.config.vocab_size, 99), output_len, budget)  # JIT
    rows = []
    for concurrency in concurrencies:
        prompts = prompts_of(concurrency, prompt_len, pair.config.vocab_size, concurrency)
        ours = run_kvseal(pair, device, dtype, prompts, output_len, budget)
        theirs = run_hf(pair, device, prompts, output_len)
        # a decode step reads every weight once and each row's KV (mid-decode context on average)
        kv_read = concurrency * (prompt_len + output_len // 2) * ours["kv_bytes_per_token"]
        roofline_ms = 1000 * (weights + kv_read) / bandwidth
        step = ours["decode_step_ms_median"]
        rows.append({"concurrency": concurrency, "kvseal": ours, "transformers": theirs,
                     "speedup_vs_transformers": ours["output_tokens_per_s"] / theirs["output_tokens_per_s"],
                     "roofline_step_ms": roofline_ms,
                     "step_over_roofline": None if step is None else step / roofline_ms})
        print(shape, rows[-1], flush=True)
    del pair
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"shape": shape, "weights_bytes": weights, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dry-run", action="store_true", help="the tiny shape, short prompts, low concurrency")
    ns = parser.parse_args()
    started = time.monotonic()
    if ns.dry_run:
        shapes, dtype, concurrencies, prompt_len, output_len, copy_bytes, budget = \
            ["tiny"], torch.float32, [1, 4], 16, 8, 2**26, 256
    else:
        shapes, dtype, concurrencies, prompt_len, output_len, copy_bytes, budget = \
            ["llama-1b", "llama-8b"], torch.bfloat16, [1, 32, 128], 256, 128, 2**31, 8192
    bandwidth = copy_bandwidth(ns.device, copy_bytes)
    results: list[dict[str, Any]] = []
    record: Callable[[], None] = lambda: write_json("throughput.json", {  # noqa: E731
        "environment": environment(), "device": ns.device, "dtype": str(dtype), "prompt_len": prompt_len,
        "output_len": output_len, "copy_bandwidth_gb_s": bandwidth / 1e9, "shapes": results,
        "seconds": round(time.monotonic() - started, 1)})
    for shape in shapes:
        results.append(bench_shape(shape, ns.device, dtype, concurrencies, prompt_len, output_len, bandwidth, budget))
        record()  # what is done so far survives a later shape's failure or timeout


if __name__ == "__main__":
    main()
