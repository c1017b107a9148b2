"""What the grammar worker processes cost: a worker's start, and a compile through the pool
against the same compile on a thread in the engine process (what kvseal did before).

A pool compile is: hand the spec to a worker process, which compiles it under the budget and
answers, then the engine's own compile of it (see `kvseal/structured/compiler.py` for why the
compiled grammar is not shipped back). Each schema is compiled `--reps` times both ways,
alternating, each time under a new title so neither path hits a cache; the median of each and
the median of (pool - thread) are printed as JSON.

    python bench/grammar_compile.py                  # the default model's vocabulary (49K)
    python bench/grammar_compile.py --model DIR --reps 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from transformers import AutoTokenizer

from kvseal.config import GrammarConfig
from kvseal.disagg.serve import tokenizer_folder
from kvseal.structured.compiler import GrammarCompilerPool
from kvseal.structured.grammars import compile_spec, new_compiler
from kvseal.structured.msgs import WorkerSetupMsg
from kvseal.structured.workers import GrammarWorker
from kvseal.types import StructuredOutput

TYPICAL = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city"]},
    "role": {"enum": ["admin", "user", "guest"]}, "active": {"type": "boolean"}, "score": {"type": "number"}},
    "required": ["name", "age", "role"]}
SCHEMAS: dict[str, dict[str, Any]] = {
    "small": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    "typical": TYPICAL,
    "50 integer ranges": {"type": "object", "properties": {
        f"p{i}": {"type": "integer", "minimum": -123456789, "maximum": 987654321} for i in range(50)}},
    "400 optional strings": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(400)}},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder whose tokenizer to use (default model if omitted)")
    parser.add_argument("--reps", type=int, default=5)
    ns = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(ns.model), local_files_only=True)
    pool = GrammarCompilerPool(tokenizer, len(tokenizer), (tokenizer.eos_token_id,), GrammarConfig(60.0, 1))
    result: dict[str, Any] = {"vocab_size": len(tokenizer), "worker_start_s": _worker_starts(pool, ns.reps)}
    compiler = new_compiler(pool._core.tokenizer_info())  # the thread path: the engine's compiler
    result["compiles"] = {name: _compare(pool, compiler, len(tokenizer), schema, ns.reps)
                          for name, schema in SCHEMAS.items()}
    pool.close()
    print(json.dumps(result, indent=2))


def _worker_starts(pool: GrammarCompilerPool, reps: int) -> list[float]:
    setup: WorkerSetupMsg = pool._core.worker_setup()
    starts = []
    for _ in range(reps):
        worker = GrammarWorker(setup)
        started_s = time.monotonic()
        worker.start(started_s + 300)
        starts.append(round(time.monotonic() - started_s, 3))
        worker.kill()
    return starts


def _compare(pool: GrammarCompilerPool, compiler: Any, vocab_size: int, schema: dict[str, Any],
             reps: int) -> dict[str, float]:
    thread_s, pool_s = [], []
    pool.compile_now("warm-up", StructuredOutput("json_object"))  # the worker is up before timing
    for rep in range(reps):
        spec = StructuredOutput("json_schema", json.dumps(schema | {"title": f"rep-{rep}"}))
        started_s = time.monotonic()
        compile_spec(compiler, vocab_size, spec.kind, spec.schema)
        thread_s.append(time.monotonic() - started_s)
        started_s = time.monotonic()
        pool.compile_now("bench", spec)
        pool_s.append(time.monotonic() - started_s)
    return {"thread_ms": round(1000 * statistics.median(thread_s), 1),
            "pool_ms": round(1000 * statistics.median(pool_s), 1),
            "overhead_ms": round(1000 * statistics.median(p - t for p, t in zip(pool_s, thread_s)), 1)}


if __name__ == "__main__":
    main()
