"""One-row decode steps over the default GGUF's blocks against its bfloat16 tiles, A/B in one process,
alternating (`--gguf-q4-rows`: the decoder linears' Q4_1 blocks, `kvseal/ops/csrc/linear_q4.c`;
the lm_head's Q8_0 blocks, `kvseal/ops/csrc/linear_q8.c`).

linears: the 30 decoder layers' linears of SmolLM2-135M's real weights at one row, as the decode
loop calls them (q/k/v, o, the fused gate/up + SiLU, down; the lm_head is not in it), each pass
over the tiles of the converted bfloat16 weights or over the Q4_1 blocks, called straight into the
library (no Python between the calls but the loop), outputs compared bit for bit.

head: the lm_head (the tied embedding table, 49,152 x 576) at one row, over its tiles or its Q8_0
blocks, the same way, each call after a read that evicts them from the last-level cache (as the
decoder's weights do in a step).

engine: single-stream decode steps of the engine alone (no server): requests one at a time,
every decode step timed, the model's linears holding no blocks (tiles), the decoder linears'
Q4_1 blocks alone (q4_1), or those and the lm_head's Q8_0 blocks (q4_1+q8_0), the three in turn
step by step, their order rotated each turn (the decode loop rebuilt at each change, untimed),
so that a burst of other work on the host falls on all three alike; ratios are of adjacent
steps. Greedy tokens compared over two requests run whole with each.

    python bench/q4_rows_ab.py --part linears --rounds 16
    python bench/q4_rows_ab.py --part head --rounds 300
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
from kvseal.models.gguf_blocks import dequantize_rows, read_gguf_blocks
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
    raw = read_gguf_blocks(path, cfg).layers
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


def compare_head(rounds: int) -> dict[str, Any]:
    k = NativeKernels.load(BuildConfig.from_environment())
    path = default_model_path()
    cfg = plan_config(path)
    blocks = read_gguf_blocks(path, cfg).head
    assert blocks is not None, "the default GGUF's lm_head (its embedding table) is Q8_0"
    tiles, packed = k.pack_tiles(dequantize_rows(blocks)), k.pack_q8_0(blocks)
    vocab, hidden, threads = blocks.shape[0], cfg.hidden_size, torch.get_num_threads()
    x = torch.randn(1, hidden).to(torch.bfloat16)
    outs = {side: torch.empty(1, vocab, dtype=torch.bfloat16) for side in ("tiles", "blocks")}
    calls = {"tiles": lambda: k.lib.kvseal_linear_tiles(k.ptr(x), k.ptr(tiles), k.NULL, k.ptr(outs["tiles"]), 1,
                                                        vocab, hidden, threads),
             "blocks": lambda: k.lib.kvseal_linear_q8_0_row(k.ptr(x), k.ptr(packed), k.NULL, k.ptr(outs["blocks"]),
                                                            vocab, hidden, threads)}
    if calls["blocks"]():
        raise RuntimeError("the row kernel declined (the tile linears run on AMX here?)")
    calls["tiles"]()
    times = alternate_cold(calls, rounds)
    fastest = {f"{side}_fastest_ms": round(min(t), 3) for side, t in times.items()}
    weight_mb = {side: round(t.numel() * t.element_size() / 1e6, 1) for side, t in (("tiles", tiles),
                                                                                     ("blocks", packed))}
    return {"part": "head", "rows": 1, "vocab": vocab, **ratio_summary(times, "tiles", "blocks", 3), **fastest,
            "bit_equal": torch.equal(outs["tiles"], outs["blocks"]), "weight_mb": weight_mb, "threads": threads}


def alternate_cold(calls: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """`alternate`, each call after a read of more bytes than the last-level cache holds (untimed):
    in a decode step the decoder's weights pass between two lm_head calls, so the head's weights
    come from memory (the 30 MB of blocks would otherwise stay in a 32 MiB L3 between passes)."""
    flood = torch.ones(EVICT_BYTES // 4)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        for name in list(calls) if r % 2 == 0 else list(calls)[::-1]:
            flood.sum()
            start = time.perf_counter()
            calls[name]()
            times[name].append(1000 * (time.perf_counter() - start))
    return times


EVICT_BYTES = 128 << 20  # read between the head's calls: several times a server CPU's L3
ENGINE_SIDES = ("tiles", "q4_1", "q4_1+q8_0")


def compare_engine(rounds: int, prompt_len: int, output_len: int) -> dict[str, Any]:
    llm = LLM(model=None, dtype="bfloat16", max_model_len=prompt_len + output_len, max_num_seqs=1,
              kv_cache_tokens=2 * (prompt_len + output_len), enable_prefix_caching=False)
    model = llm.engine.runner.model
    held_q4_1 = {m: m.q4_1 for m in model.modules() if isinstance(m, TileLinear) and m.q4_1 is not None}
    head = model.lm_head
    assert held_q4_1 and isinstance(head, TileLinear) and head.q8_0 is not None, \
        "the linears hold no blocks (not an AVX512-BF16 host, or --no-gguf-q4-rows?)"
    held_q8_0 = head.q8_0

    def use_blocks(side: str) -> None:
        for module, blocks in held_q4_1.items():
            module.q4_1 = blocks if side != "tiles" else None
        head.q8_0 = held_q8_0 if side == "q4_1+q8_0" else None
        model.use_ops(model.ops)
        model.decode_loop()  # its table built again now, outside the timed step

    step_ms: dict[str, list[float]] = {side: [] for side in ENGINE_SIDES}
    plain_run = llm.engine.runner.run
    decode_steps = 0

    def timed_run(batch: ForwardBatch) -> Any:
        nonlocal decode_steps
        if not all(int(n) == 1 for n in batch.query_lens):
            return plain_run(batch)
        turn = decode_steps // len(ENGINE_SIDES)  # each turn runs every side once, its order rotated
        side = ENGINE_SIDES[(decode_steps + turn) % len(ENGINE_SIDES)]
        decode_steps += 1
        use_blocks(side)
        start = time.perf_counter()
        result = plain_run(batch)
        step_ms[side].append(1000 * (time.perf_counter() - start))
        return result

    from kvseal import SamplingParams
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    prompts = [[(1000 + 37 * r + 11 * i) % 40000 + 100 for i in range(prompt_len)] for r in range(rounds)]
    tokens: dict[str, list[list[int]]] = {}
    for side in ENGINE_SIDES:  # each side whole, for the tokens
        use_blocks(side)
        tokens[side] = [out.token_ids for out in llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                                                              params)]
    llm.engine.runner.run = timed_run  # type: ignore[method-assign]
    for prompt in prompts:
        llm.generate([{"prompt_token_ids": prompt}], params)  # type: ignore[list-item]
    llm.engine.close()

    def ratio(a: str, b: str) -> float:  # of adjacent steps' times
        return round(statistics.median(y / x for x, y in zip(step_ms[a], step_ms[b])), 3)

    return {"part": "engine", "rows": 1, "rounds": rounds, "prompt_len": prompt_len, "output_len": output_len,
            "steps_per_side": len(step_ms["tiles"]),
            **{f"{side}_step_median_ms": round(statistics.median(step_ms[side]), 2) for side in ENGINE_SIDES},
            "q4_1_over_tiles_median": ratio("tiles", "q4_1"),
            "q4_1+q8_0_over_q4_1_median": ratio("q4_1", "q4_1+q8_0"),
            "q4_1+q8_0_over_tiles_median": ratio("tiles", "q4_1+q8_0"),
            "same_tokens": tokens["tiles"] == tokens["q4_1"] == tokens["q4_1+q8_0"],
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["linears", "head", "engine"], nargs="+",
                        default=["linears", "head", "engine"])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    if "linears" in args.part:
        print(json.dumps(compare_linears(args.rounds)), flush=True)
    if "head" in args.part:
        print(json.dumps(compare_head(args.rounds)), flush=True)
    if "engine" in args.part:
        print(json.dumps(compare_engine(args.rounds, args.prompt_len, args.output_len)), flush=True)


if __name__ == "__main__":
    main()
