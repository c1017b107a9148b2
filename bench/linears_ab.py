"""Two trees' linears, A/B in one process, alternating: ms per pass over a SmolLM2-135M-shaped
stack (30 layers' q/k/v, o, gate/up and down with distinct weights, so nothing stays in cache,
and the lm_head) at each row count: float32 panel linears, or with `--dtype bfloat16` the
bfloat16 tile linears (AMX or AVX512-BF16, whichever the host runs).

This host's speed drifts by 10-20% from minute to minute, which swamps a kernel change of a
few percent when the two trees run one after the other. Here both libraries are built from
each tree's C sources (`kvseal/ops/csrc/`) and loaded side by side, both called through this
tree's bindings (a function whose signature differs between the trees is a TypeError, never a
wrong call), the passes alternate (ABBA...), and the figure of merit is the median of the B/A
ratios of adjacent passes. Outputs are compared bit for bit. Trees from before the kernels were
C files (their C in `kvseal/models/csrc.py`) are not comparable with this script: run that
tree's own copy of it against another such tree.

    python bench/linears_ab.py --a /path/to/base --b . --rows 8 32 96 256 --rounds 12
    python bench/linears_ab.py --a /path/to/base --b . --dtype bfloat16 --rows 32 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from engine_speed import SMOLLM2_LINEARS as SHAPES  # bench/ is on the path when this file runs

from kvseal.ops.native_build import BuildConfig, NativeBuildError
from kvseal.ops.native_kernels import NativeKernels

T = TypeVar("T")


def alternate(runs: dict[str, Callable[[], T]], rounds: int) -> tuple[dict[str, list[float]], dict[str, T]]:
    """Two runs, `rounds` times each, alternating (AB, BA, AB, ...): ms per call of each, and
    each one's last result."""
    first, second = runs
    times: dict[str, list[float]] = {first: [], second: []}
    results: dict[str, T] = {}
    for r in range(rounds):
        for name in (first, second) if r % 2 == 0 else (second, first):
            start = time.perf_counter()
            results[name] = runs[name]()
            times[name].append(1000 * (time.perf_counter() - start))
    return times, results


def ratio_summary(times: dict[str, list[float]], base: str, other: str, ms_digits: int = 1) -> dict[str, Any]:
    """Medians of each side, and of the other/base ratios of adjacent calls, with their range."""
    ratios = sorted(t_other / t_base for t_base, t_other in zip(times[base], times[other]))
    return {f"{base}_median_ms": round(statistics.median(times[base]), ms_digits),
            f"{other}_median_ms": round(statistics.median(times[other]), ms_digits),
            f"{other}_over_{base}_median": round(statistics.median(ratios), 3),
            f"{other}_over_{base}_range": [round(ratios[0], 3), round(ratios[-1], 3)]}


def library_of(tree: Path) -> NativeKernels:
    """Build (or reuse from the cache) and load the kernels of `tree`'s C sources."""
    csrc = tree / "kvseal" / "ops" / "csrc"
    if not csrc.is_dir():
        raise SystemExit(f"no kvseal/ops/csrc/ under {tree}: a tree from before the kernels were C files is not "
                         f"comparable with this script (use that tree's own bench/ scripts)")
    try:
        return NativeKernels.load(replace(BuildConfig.from_environment(), csrc=csrc))
    except NativeBuildError as error:
        raise SystemExit(f"the native kernels of {tree} did not build: {error}") from error


def compare(a: NativeKernels, b: NativeKernels, rows: int, rounds: int,
            dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    inputs = [torch.randn(rows, k, dtype=dtype) for k, _ in SHAPES]
    if dtype == torch.bfloat16:
        tiles = [a.pack_tiles(torch.randn(n, k, dtype=dtype)) for k, n in SHAPES]

        def stack(kernels: NativeKernels) -> list[torch.Tensor]:
            return [kernels.linear_tiles(x, t, None, n) for x, t, (_, n) in zip(inputs, tiles, SHAPES)]
    else:
        panels = [a.pack_panels(torch.randn(n, k)) for k, n in SHAPES]

        def stack(kernels: NativeKernels) -> list[torch.Tensor]:
            return [kernels.linear_panels(x, p, None, n) for x, p, (_, n) in zip(inputs, panels, SHAPES)]

    times, outputs = alternate({"a": partial(stack, a), "b": partial(stack, b)}, rounds)
    return {"rows": rows, **ratio_summary(times, "a", "b"),
            "bit_equal": all(torch.equal(x, y) for x, y in zip(outputs["a"], outputs["b"]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, required=True, help="baseline tree")
    parser.add_argument("--b", type=Path, default=Path("."), help="tree under test (default: here)")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 96, 256])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="float32 panels, or bfloat16 tiles (needs AMX or AVX512-BF16)")
    args = parser.parse_args()
    a, b = library_of(args.a.resolve()), library_of(args.b.resolve())
    dtype = getattr(torch, args.dtype)
    for rows in args.rows:
        print(json.dumps({**compare(a, b, rows, args.rounds, dtype), "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
