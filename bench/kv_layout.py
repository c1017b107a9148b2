"""KV pool layout for PD (issue 7): decode attention over a head-major pool (kvseal's) vs a
page-major pool (one page of one layer contiguous: one transfer descriptor per page).

Decode attention gathers each sequence's pages and runs two matmuls per KV head. Head-major
`[kv_heads, pages, page_size, head_dim]` gives each head's context contiguously after one
gather; page-major `[pages, kv_heads, page_size, head_dim]` needs either a permute copy after
the gather or a matmul broadcast over pages. Printed: ms per call, SmolLM2-135M's attention
shape (9 heads, 3 KV heads, head_dim 64), page size 16, for several batch/context sizes.

    python bench/kv_layout.py --threads 1
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

KV_HEADS, GROUP, HEAD_DIM, PAGE = 3, 3, 64, 16


def ms(fn: Callable[[], torch.Tensor], n: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def attend(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    scores = torch.matmul(qg, k.transpose(2, 3)).float() * HEAD_DIM**-0.5  # [H, B, G, C]
    scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1).to(v.dtype), v)


def run(dtype: torch.dtype, batch: int, context: int, n: int) -> str:
    num_pages = context // PAGE
    total = batch * num_pages * 2
    head_major = torch.randn(KV_HEADS, total, PAGE, HEAD_DIM, dtype=dtype)
    page_major = torch.randn(total, KV_HEADS, PAGE, HEAD_DIM, dtype=dtype)
    pages = torch.randperm(total)[: batch * num_pages]
    q = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, dtype=dtype)
    qg = q.view(batch, KV_HEADS, GROUP, HEAD_DIM).transpose(0, 1)
    mask = torch.ones(1, batch, 1, num_pages * PAGE, dtype=torch.bool)

    def hm() -> torch.Tensor:
        k = torch.index_select(head_major, 1, pages).view(KV_HEADS, batch, -1, HEAD_DIM)
        v = torch.index_select(head_major, 1, pages).view(KV_HEADS, batch, -1, HEAD_DIM)
        return attend(qg, k, v, mask)

    def pm() -> torch.Tensor:
        def gather() -> torch.Tensor:
            g = torch.index_select(page_major, 0, pages).view(batch, num_pages, KV_HEADS, PAGE, HEAD_DIM)
            return g.permute(2, 0, 1, 3, 4).reshape(KV_HEADS, batch, -1, HEAD_DIM)
        return attend(qg, gather(), gather(), mask)

    return (f"{str(dtype).removeprefix('torch.'):>8} batch {batch:>3} context {context:>5}: "
            f"head-major {ms(hm, n):7.2f} ms   page-major {ms(pm, n):7.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--iterations", type=int, default=10)
    ns = parser.parse_args()
    if ns.threads is not None:
        torch.set_num_threads(ns.threads)
    for dtype in (torch.float32, torch.bfloat16):
        for batch, context in ((8, 512), (32, 512), (8, 2048)):
            print(run(dtype, batch, context, ns.iterations))


if __name__ == "__main__":
    main()
