"""Decode attention against a plain read of the same bytes: the float32 native kernel over 30
layers' pools (3 KV heads x 2,048 pages of 16 slots x 64 dims each, 1.5 GB in all, so it does
not stay in cache), each row's pages consecutive as the engine allocates them, against torch
summing the same K and V slices. Median of 12 passes, ms per 30 layers and GB/s.

    python bench/attention_read.py
"""

from __future__ import annotations

import statistics
import time

import torch

from kvseal.ops.native_build import BuildConfig, NativeBuildError
from kvseal.ops.native_kernels import NativeKernels

LAYERS, KV_HEADS, PAGES, PAGE_SIZE, HEAD_DIM, HEADS, CONTEXT = 30, 3, 2048, 16, 64, 9, 320


def main() -> None:
    try:
        kernels = NativeKernels.load(BuildConfig.from_environment())
    except NativeBuildError as error:
        raise SystemExit(f"the native kernels did not build here: {error}") from error
    pools = [(torch.randn(KV_HEADS, PAGES, PAGE_SIZE, HEAD_DIM), torch.randn(KV_HEADS, PAGES, PAGE_SIZE, HEAD_DIM))
             for _ in range(LAYERS)]
    per_row = -(-CONTEXT // PAGE_SIZE)
    first = 7  # the rows' pages start away from the pool's first page, as a running pool's would
    for rows in (8, 32):
        tables = torch.arange(rows * per_row, dtype=torch.int64).view(rows, per_row) + first
        lens = torch.full((rows,), CONTEXT, dtype=torch.int64)
        queries = [torch.randn(rows, HEADS, HEAD_DIM) for _ in range(LAYERS)]
        nbytes = rows * CONTEXT * KV_HEADS * HEAD_DIM * 4 * 2 * LAYERS
        attend, read = [], []
        for _ in range(12):
            start = time.perf_counter()
            for (k, v), q in zip(pools, queries):
                kernels.decode_attention(q, k, v, tables, lens, CONTEXT)
            attend.append(time.perf_counter() - start)
            start = time.perf_counter()
            for k, v in pools:
                k[:, first:first + rows * per_row].sum()
                v[:, first:first + rows * per_row].sum()
            read.append(time.perf_counter() - start)
        a, r = statistics.median(attend), statistics.median(read)
        print(f"rows {rows}: attention {1000 * a:.1f} ms ({nbytes / a / 1e9:.1f} GB/s), "
              f"torch reading the same bytes {1000 * r:.1f} ms ({nbytes / r / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
