"""Two trees' decode attention (float32, or with `--dtype bfloat16` the bfloat16 pool's kernel
with the scores it runs in the engine), A/B in one process, alternating: ms per pass over 30
layers' pools (3 KV heads x 2,048 pages of 16 slots x 64 dims each, 1.5 GB in float32, so nothing
stays in cache, on huge pages where the kernel offers them, as the engine's pool is), with
SmolLM2-135M's 9 query heads and each row's pages consecutive as the engine allocates them,
at each row count.

As in `bench/linears_ab.py`, both libraries are built from each tree's `kvseal/ops/csrc/` (trees
from before the kernels were C files are not comparable with it) and loaded side by side, the
passes alternate (ABBA...), and the figure of merit is the median
of the B/A ratios of adjacent passes. Outputs are compared bit for bit, and by their largest
difference where they are not bit-equal.

    python bench/attention_ab.py --a /path/to/base --b . --rows 8 32 --context 320
    python bench/attention_ab.py --a /path/to/base --b . --dtype bfloat16 --context 320 --prompt-pages 16
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path
from typing import Any

import torch
from linears_ab import alternate, library_of, ratio_summary  # bench/ is on the path when this file runs

from kvseal.hugepages import huge_empty
from kvseal.ops.native_kernels import NativeKernels

LAYERS, KV_HEADS, PAGES, PAGE_SIZE, HEAD_DIM, HEADS = 30, 3, 2048, 16, 64, 9


def page_tables(rows: int, per_row: int, prompt_pages: int | None) -> torch.Tensor:
    """[rows, per_row] page ids. prompt_pages None: each row's pages consecutive. Else as a
    fresh pool hands them out while the rows run together: each row's first prompt_pages pages
    one consecutive run (its prompt's, allocated at once), every later page appended one step at
    a time by each row in turn, so that row's next page is `rows` pages further on."""
    first = 7  # the rows' pages start away from the pool's first page, as a running pool's would
    if prompt_pages is None or prompt_pages >= per_row:
        return torch.arange(rows * per_row, dtype=torch.int64).view(rows, per_row) + first
    prompt = torch.arange(rows * prompt_pages, dtype=torch.int64).view(rows, prompt_pages)
    later = torch.arange(rows * (per_row - prompt_pages), dtype=torch.int64).view(per_row - prompt_pages, rows).T
    return torch.cat([prompt, later + rows * prompt_pages], dim=1) + first


def compare(a: NativeKernels, b: NativeKernels, pools: list[tuple[torch.Tensor, torch.Tensor]],
            rows: int, context: int, rounds: int, prompt_pages: int | None = None) -> dict[str, Any]:
    dtype = pools[0][0].dtype
    per_row = -(-context // PAGE_SIZE)
    tables = page_tables(rows, per_row, prompt_pages)
    lens = torch.full((rows,), context, dtype=torch.int64) - torch.arange(rows) % PAGE_SIZE  # ragged last pages
    queries = [torch.randn(rows, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS)]

    def layers(kernels: NativeKernels) -> list[torch.Tensor]:
        return [kernels.decode_attention(q, k, v, tables, lens, context) for (k, v), q in zip(pools, queries)]

    times, outputs = alternate({"a": partial(layers, a), "b": partial(layers, b)}, rounds)
    return {"rows": rows, "context": context, "prompt_pages": prompt_pages,
            **ratio_summary(times, "a", "b", ms_digits=2),
            "bit_equal": all(torch.equal(x, y) for x, y in zip(outputs["a"], outputs["b"])),
            "max_abs_diff": max(float((x - y).abs().max()) for x, y in zip(outputs["a"], outputs["b"]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, required=True, help="baseline tree")
    parser.add_argument("--b", type=Path, default=Path("."), help="tree under test (default: here)")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[320])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the pool's dtype")
    parser.add_argument("--prompt-pages", type=int, default=None,
                        help="each row's first N pages consecutive, the later ones interleaved with the other "
                             "rows' as decode steps append them (default: every page of a row consecutive)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    a, b = library_of(args.a.resolve()), library_of(args.b.resolve())
    shape = (KV_HEADS, PAGES, PAGE_SIZE, HEAD_DIM)  # on huge pages where offered, as the engine's pool
    pools = [(huge_empty(shape, dtype).normal_(), huge_empty(shape, dtype).normal_())
             for _ in range(LAYERS)]
    for context in args.context:
        for rows in args.rows:
            result = compare(a, b, pools, rows, context, args.rounds, args.prompt_pages)
            print(json.dumps({**result, "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
