"""One-row decode steps over the default GGUF's Q4_1 blocks against its bfloat16 tiles, A/B in one
process, alternating (`--gguf-q4-rows`, `kvseal/ops/csrc/linear_q4.c`).

linears: the 30 decoder layers' linears of SmolLM2-135M's real weights at one row, as the decode
loop calls them (q/k/v, o, the fused gate/up + SiLU, down; the lm_head is not in it), each pass
over the tiles of the converted bfloat16 weights or over the blocks, called straight into the
library (no Python between the calls but the loop), outputs compared bit for bit.

engine: single-stream decode steps of the engine alone (no server): requests one at a time,
every decode step timed, the model's linears holding their blocks for one request and not for
the next (the decode loop rebuilt each time), greedy tokens compared request by request.

    python bench/q4_rows_ab.py --part linears --rounds 16
    python bench/q4_rows_ab.py --part engine --rounds 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from linears_ab import alternate, ratio_summary  # bench/ is on the path when this file runs

from kvseal.llm import LLM
from kvseal.model_files import default_model_path
from kvseal.models.gguf_blocks import dequantize_rows, read_q4_1_linears
from kvseal.models.loader import plan_config
from kvseal.ops.native_build import BuildConfig
from kvseal.ops.native_kernels import NativeKernels
from kvseal.ops.native_linears import TileLinear
from kvseal.types import ForwardBatch

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def linears_pass(k: NativeKernels, weights: list[dict[str, torch.Tensor]], blocks: bool,
                 x: dict[str, torch.Tensor], out: dict[str, torch.Tensor], inter: int) -> Callable[[], None]:
    """One pass over every layer's four linears at one row, into `out`."""
    lib, threads = k.lib, torch.get_num_threads()
    ptr = k.ptr
    calls = []
    for layer in weights:
        for name in LINEARS:
            w, n_out, k_in = ptr(layer[name]), out[name].shape[1], x[name].shape[1]
            xi, yi = ptr(x[name]), ptr(out[name])
            if name == "gate_up_proj":
                calls.append((lib.kvseal_linear_silu_q4_1_row, (xi, w, yi, inter, k_in, threads)) if blocks
                             else (lib.kvseal_linear_silu_tiles, (xi, w, yi, 1, inter, k_in, threads)))
            else:
                calls.append((lib.kvseal_linear_q4_1_row, (xi, w, k.NULL, yi, n_out, k_in, threads)) if blocks
                             else (lib.kvseal_linear_tiles, (xi, w, k.NULL, yi, 1, n_out, k_in, threads)))

    def run() -> None:
        for call, arguments in calls:
            if call(*arguments):
                raise RuntimeError("a row kernel declined (the tile linears run on AMX here?)")
    return run


def compare_linears(rounds: int) -> dict[str, Any]:
    k = NativeKernels.load(BuildConfig.from_environment())
    path = default_model_path()
    cfg = plan_config(path)
    raw = read_q4_1_linears(path, cfg)
    assert raw is not None, "the default GGUF's decoder linears are Q4_1"
    tiles = [{name: k.pack_tiles(dequantize_rows(layer[name])) for name in LINEARS} for layer in raw]
    packed = [{name: k.pack_q4_1(layer[name]) for name in LINEARS} for layer in raw]
    hidden, inter, q_size = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
    x = {"qkv_proj": hidden, "o_proj": q_size, "gate_up_proj": hidden, "down_proj": inter}
    inputs = {name: torch.randn(1, width).to(torch.bfloat16) for name, width in x.items()}
    widths = {"qkv_proj": raw[0]["qkv_proj"].shape[0], "o_proj": hidden, "gate_up_proj": inter, "down_proj": hidden}
    outs = {side: {name: torch.empty(1, n, dtype=torch.bfloat16) for name, n in widths.items()}
            for side in ("tiles", "blocks")}
    runs = {"tiles": linears_pass(k, tiles, False, inputs, outs["tiles"], inter),
            "blocks": linears_pass(k, packed, True, inputs, outs["blocks"], inter)}
    for run in runs.values():
        run()  # warm: first touches
    times, _ = alternate(runs, rounds)
    equal = all(torch.equal(outs["tiles"][n], outs["blocks"][n]) for n in LINEARS)
    weight_mb = {side: round(sum(t.numel() * t.element_size() for layer in w for t in layer.values()) / 1e6, 1)
                 for side, w in (("tiles", tiles), ("blocks", packed))}
    fastest = {f"{side}_fastest_ms": round(min(t), 2) for side, t in times.items()}  # the least disturbed pass
    return {"part": "linears", "rows": 1, "linears": 4 * len(raw), **ratio_summary(times, "tiles", "blocks", 2),
            **fastest,
            "bit_equal_last_layer": equal, "weight_mb": weight_mb, "threads": torch.get_num_threads()}


def compare_engine(rounds: int, prompt_len: int, output_len: int) -> dict[str, Any]:
    llm = LLM(model=None, dtype="bfloat16", max_model_len=prompt_len + output_len, max_num_seqs=1,
              kv_cache_tokens=2 * (prompt_len + output_len), enable_prefix_caching=False)
    model = llm.engine.runner.model
    held = {m: m.q4_1 for m in model.modules() if isinstance(m, TileLinear) and m.q4_1 is not None}
    assert held, "no linear holds Q4_1 blocks (not an AVX512-BF16 host, or --no-gguf-q4-rows?)"
    steps: list[float] = []
    plain_run = llm.engine.runner.run

    def timed_run(batch: ForwardBatch) -> Any:
        start = time.perf_counter()
        result = plain_run(batch)
        if all(int(n) == 1 for n in batch.query_lens):
            steps.append(1000 * (time.perf_counter() - start))
        return result

    llm.engine.runner.run = timed_run  # type: ignore[method-assign]

    def use_blocks(on: bool) -> None:
        for module, blocks in held.items():
            module.q4_1 = blocks if on else None
        model.use_ops(model.ops)  # the decode loop's table is built again at the next step

    from kvseal import SamplingParams
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    step_ms: dict[str, list[float]] = {"tiles": [], "blocks": []}
    tokens: dict[str, list[list[int]]] = {"tiles": [], "blocks": []}
    for r in range(rounds):
        prompt = [(1000 + 37 * r + 11 * i) % 40000 + 100 for i in range(prompt_len)]
        for side in ("tiles", "blocks") if r % 2 == 0 else ("blocks", "tiles"):
            use_blocks(side == "blocks")
            steps.clear()
            out = llm.generate([{"prompt_token_ids": prompt}], params)[0]  # type: ignore[list-item]
            step_ms[side].append(statistics.median(steps))
            tokens[side].append(out.token_ids)
    llm.engine.close()
    ratios = sorted(b / a for a, b in zip(step_ms["tiles"], step_ms["blocks"]))
    return {"part": "engine", "rows": 1, "rounds": rounds, "prompt_len": prompt_len, "output_len": output_len,
            "tiles_step_median_ms": round(statistics.median(step_ms["tiles"]), 2),
            "blocks_step_median_ms": round(statistics.median(step_ms["blocks"]), 2),
            "blocks_over_tiles_median": round(statistics.median(ratios), 3),
            "same_tokens": tokens["tiles"] == tokens["blocks"], "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["linears", "engine"], nargs="+", default=["linears", "engine"])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    if "linears" in args.part:
        print(json.dumps(compare_linears(args.rounds)), flush=True)
    if "engine" in args.part:
        print(json.dumps(compare_engine(args.rounds, args.prompt_len, args.output_len)), flush=True)


if __name__ == "__main__":
    main()
