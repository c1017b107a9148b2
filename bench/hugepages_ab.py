"""Huge pages against ordinary pages, in one process, alternating: the float32 decode attention
over 30 layers' pools (as `bench/attention_ab.py`) and the panel linears over the SmolLM2-135M
stack with its lm_head (as `bench/linears_ab.py`), each on one copy of the data made with
`kvseal.hugepages.huge_empty` and one made with `torch.empty`. The figure of merit is the
median of the huge/plain ratios of adjacent passes. Prints how much of the process's memory the
kernel backed with huge pages (AnonHugePages), so a host without them reads as such.

    python bench/hugepages_ab.py --rows 8 32 --rounds 12
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from engine_speed import SMOLLM2_LINEARS as SHAPES  # bench/ is on the path when this file runs
from linears_ab import alternate, ratio_summary

from kvseal.hugepages import huge_empty
from kvseal.ops.native_build import BuildConfig, NativeBuildError
from kvseal.ops.native_kernels import NativeKernels

LAYERS, KV_HEADS, PAGES, PAGE_SIZE, HEAD_DIM, HEADS, CONTEXT = 30, 3, 2048, 16, 64, 9, 320


def huge_kib() -> int:
    """This process's memory on transparent huge pages, KiB (0 where /proc says nothing)."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return 0
    match = re.search(r"^AnonHugePages:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    try:
        kernels = NativeKernels.load(BuildConfig.from_environment())
    except NativeBuildError as error:
        raise SystemExit(f"the native kernels did not build here: {error}") from error
    before = huge_kib()
    make: dict[str, Callable[..., torch.Tensor]] = {
        "plain": torch.empty, "huge": lambda *shape: huge_empty(shape, torch.float32)}
    shape = (KV_HEADS, PAGES, PAGE_SIZE, HEAD_DIM)
    pools = {name: [(m(*shape).normal_(), m(*shape).normal_()) for _ in range(LAYERS)] for name, m in make.items()}
    weights = [torch.randn(n, k) for k, n in SHAPES]
    panels = {"plain": [kernels.pack_panels(w) for w in weights]}
    panels["huge"] = []
    for p in panels["plain"]:
        copy = huge_empty(p.shape, p.dtype)
        copy.copy_(p)
        panels["huge"].append(copy)
    print(json.dumps({"anon_huge_pages_mib": round((huge_kib() - before) / 1024)}), flush=True)
    per_row = -(-CONTEXT // PAGE_SIZE)
    for rows in args.rows:
        tables = torch.arange(rows * per_row, dtype=torch.int64).view(rows, per_row) + 7
        lens = torch.full((rows,), CONTEXT, dtype=torch.int64)
        queries = [torch.randn(rows, HEADS, HEAD_DIM) for _ in range(LAYERS)]
        inputs = [torch.randn(rows, k) for k, _ in SHAPES]

        def attend(name: str, tables: torch.Tensor = tables, lens: torch.Tensor = lens,
                   queries: list[torch.Tensor] = queries) -> None:
            for (k, v), q in zip(pools[name], queries):
                kernels.decode_attention(q, k, v, tables, lens, CONTEXT)

        def linears(name: str, inputs: list[torch.Tensor] = inputs) -> None:
            for x, p, (_, n) in zip(inputs, panels[name], SHAPES):
                kernels.linear_panels(x, p, None, n)

        for part, run in (("decode attention", attend), ("linears", linears)):
            times, _ = alternate({"plain": partial(run, "plain"), "huge": partial(run, "huge")}, args.rounds)
            print(json.dumps({"part": part, "rows": rows, **ratio_summary(times, "plain", "huge", ms_digits=2),
                              "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
