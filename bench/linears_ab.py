"""Two trees' linears, A/B in one process, alternating: ms per pass over a SmolLM2-135M-shaped
stack (30 layers' q/k/v, o, gate/up and down with distinct weights, so nothing stays in cache,
and the lm_head) at each row count: float32 panel linears, or with `--dtype bfloat16` the
bfloat16 tile linears (AMX or AVX512-BF16, whichever the host runs).

This host's speed drifts by 10-20% from minute to minute, which swamps a kernel change of a
few percent when the two trees run one after the other. Here both libraries are built from
each tree's `kvseal/models/csrc.py` and loaded side by side, the passes alternate (ABBA...),
and the figure of merit is the median of the B/A ratios of adjacent passes. Outputs are
compared bit for bit.

    python bench/linears_ab.py --a /path/to/base --b . --rows 8 32 96 256 --rounds 12
    python bench/linears_ab.py --a /path/to/base --b . --dtype bfloat16 --rows 32 2048
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from engine_speed import SMOLLM2_LINEARS as SHAPES  # bench/ is on the path when this file runs

import kvseal.models.native as native

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


def library_of(tree: Path) -> native.NativeLibrary:
    """Build (or reuse from the cache) and load the native library of `tree`'s kernel sources."""
    spec = importlib.util.spec_from_file_location(f"csrc_{abs(hash(tree))}", tree / "kvseal" / "models" / "csrc.py")
    if spec is None or spec.loader is None:
        raise SystemExit(f"no kvseal/models/csrc.py under {tree}")
    csrc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(csrc)
    library = native._load(native.library_source(csrc))
    if library is None:
        raise SystemExit(f"the native kernels of {tree} did not build")
    return library


def compare(a: native.NativeLibrary, b: native.NativeLibrary, rows: int, rounds: int,
            dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    inputs = [torch.randn(rows, k, dtype=dtype) for k, _ in SHAPES]
    if dtype == torch.bfloat16:
        tiles = [native.pack_tiles(a, torch.randn(n, k, dtype=dtype)) for k, n in SHAPES]

        def stack(library: native.NativeLibrary) -> list[torch.Tensor]:
            return [native.linear_tiles(library, x, t, None, n) for x, t, (_, n) in zip(inputs, tiles, SHAPES)]
    else:
        panels = [native.pack_panels(a, torch.randn(n, k)) for k, n in SHAPES]

        def stack(library: native.NativeLibrary) -> list[torch.Tensor]:
            return [native.linear_panels(library, x, p, None, n) for x, p, (_, n) in zip(inputs, panels, SHAPES)]

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
