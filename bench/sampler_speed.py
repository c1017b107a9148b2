"""The sampler's time per step, by backend and request kind: `engine.sampler.sample` on one
step's logits ([rows, vocab] bfloat16, the default model's 49,152-token vocabulary unless
--vocab), greedy, temperature 1 and temperature 1 with top_p 0.95, at 1, 8 and 32 rows.

    python bench/sampler_speed.py            # prints one JSON line per (backend, rows, kind)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvseal.engine.sampler import sample
from kvseal.ops import Ops, TorchOps
from kvseal.ops.dispatch import select_ops
from kvseal.types import Request, SamplingParams

KINDS = {"greedy": {"temperature": 0.0}, "temperature 1": {"temperature": 1.0},
         "top_p 0.95": {"temperature": 1.0, "top_p": 0.95}}


def time_ms(ops: Ops, rows: int, vocab: int, kind: dict[str, float], repeats: int) -> float:
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 3).to(torch.bfloat16)
    params = SamplingParams(max_tokens=128, ignore_eos=True, **kind)  # type: ignore[arg-type]
    requests = [Request(f"r{i}", "t", [1, 2, 3], params, generator=torch.Generator().manual_seed(i))
                for i in range(rows)]
    for _ in range(3):
        sample(logits, requests, (0,), ops)
    start = time.perf_counter()
    for _ in range(repeats):
        sample(logits, requests, (0,), ops)
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    backends: dict[str, Ops] = {"torch": TorchOps(), "native": select_ops("require")}
    for name, ops in backends.items():
        for rows in (1, 8, 32):
            for kind, params in KINDS.items():
                print(json.dumps({"backend": name, "rows": rows, "kind": kind, "threads": torch.get_num_threads(),
                                  "ms": round(time_ms(ops, rows, args.vocab, params, args.repeats), 3)}), flush=True)


if __name__ == "__main__":
    main()
