"""Two trees' fresh-prefill attention kernels, A/B in one process, alternating: ms per pass over
30 layers of one prefill step (`--chunks` chunks of `--length` tokens, each starting at position
0), SmolLM2-135M's heads (9 query heads, 3 KV heads, head_dim 64), distinct qkv rows per layer.

As in `bench/linears_ab.py`, both libraries are built from each tree's `kvseal/ops/csrc/` (trees
from before the kernels were C files are not comparable with it) and loaded side by side, the
passes alternate (ABBA...), and the figure of merit is the median
of the B/A ratios of adjacent passes. Outputs are compared by their largest difference (0: bit-equal).

    python bench/prefill_attention_ab.py --a /path/to/base --b . --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
from linears_ab import alternate, library_of, ratio_summary  # bench/ is on the path when this file runs

from kvseal.ops.native_kernels import NativeKernels

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, required=True, help="baseline tree")
    parser.add_argument("--b", type=Path, default=Path("."), help="tree under test (default: here)")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16",
                        help="the rows' dtype (bfloat16 needs AVX512-BF16)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    a, b = library_of(args.a.resolve()), library_of(args.b.resolve())
    rows, width = args.chunks * args.length, (HEADS + 2 * KV_HEADS) * HEAD_DIM
    layers = [torch.randn(rows, width, dtype=dtype) for _ in range(LAYERS)]
    starts = torch.arange(args.chunks, dtype=torch.int64) * args.length

    def attend(kernels: NativeKernels) -> list[torch.Tensor]:
        outputs = []
        for qkv in layers:
            out = torch.empty(rows, HEADS, HEAD_DIM, dtype=dtype)
            kernels.prefill_attention(qkv, starts, args.length, HEADS, KV_HEADS, HEAD_DIM, out)
            outputs.append(out)
        return outputs

    times, outputs = alternate({"a": partial(attend, a), "b": partial(attend, b)}, args.rounds)
    diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(outputs["a"], outputs["b"]))
    print(json.dumps({"chunks": args.chunks, "length": args.length, "dtype": args.dtype,
                      **ratio_summary(times, "a", "b", ms_digits=2), "max_abs_diff": diff,
                      "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
