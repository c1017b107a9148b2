"""The engine's command-line flags and their `EngineArgs` (shared by `generate` and `serve`).

Kept apart from `kvseal.cli` so the server imports the engine's arguments without the CLI.
"""

from __future__ import annotations

import argparse

from kvseal.config import NATIVE_MODES, QUANTIZATIONS, EngineArgs

_DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
                  "fp16": "float16", "float16": "float16", "half": "float16"}


def dtype_arg(value: str) -> str:
    if value == "auto":
        return value
    if value not in _DTYPE_ALIASES:
        raise argparse.ArgumentTypeError(f"dtype must be one of {', '.join(_DTYPE_ALIASES)}")
    return _DTYPE_ALIASES[value]


def _max_model_len(value: str) -> int | str:
    return "auto" if value == "auto" else int(value)


def add_engine_arguments(parser: argparse.ArgumentParser, *, with_threads: bool = True) -> None:
    """Flags that become `EngineArgs` fields (shared by generate, serve and engine).

    `with_threads` False leaves `--threads` to the caller (`kvseal engine` defines its own,
    with the same meaning and dest)."""
    d = EngineArgs()
    parser.add_argument("--model", default=None, help="local model folder or .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--dtype", type=dtype_arg, default=d.dtype)
    parser.add_argument("--quantization", default=d.quantization, help="weight-only quantization of the linear "
                        f"layers: {', '.join(QUANTIZATIONS)} (default: none)")
    parser.add_argument("--max-model-len", type=_max_model_len, default=None, help="integer or 'auto'")
    parser.add_argument("--kv-cache-tokens", type=int, default=None, help="KV pool size in tokens")
    parser.add_argument("--kv-cache-memory", default=d.kv_cache_memory, help="KV pool budget when "
                        "--kv-cache-tokens is not given (e.g. 2GiB)")
    parser.add_argument("--kv-headroom", type=float, default=d.kv_headroom)
    parser.add_argument("--page-size", type=int, default=d.page_size)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--max-prefill-chunk-tokens", type=int, default=None, help="most prefill tokens one "
                        "request gets per step, so other requests and tenants share the budget "
                        "(default: 512, or --max-num-batched-tokens if smaller)")
    parser.add_argument("--fair-share-tokens", type=int, default=d.fair_share_tokens, help="while other "
                        "tenants have requests in flight, the most prefill work (in tokens; a token deep in a "
                        "long prompt counts for more, by its attention) a tenant gets in one step, unless it "
                        "has the least prefill left: keeps steps short while another tenant waits "
                        f"(default: {d.fair_share_tokens})")
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--kv-scrub", choices=("off", "free", "alloc"), default=d.kv_scrub)
    parser.add_argument("--check-kv", action="store_true", help="checked mode: NaN-poison freed pages and "
                        "verify every read slot was written by its reader (I4)")
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="turn off the prefix cache (on by default; per tenant, I5): every prompt is "
                        "prefilled in full")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--native", choices=NATIVE_MODES, default=d.native, help="the engine's kernels: auto (kvseal's "
                        "native kernels, built with the C compiler ($CC, else cc) at first start and cached, or "
                        "torch's ops if they cannot be built), require (the native kernels, or start-up fails with "
                        "the compiler's message), off (torch's ops); default auto")
    parser.add_argument("--grammar-compile-timeout-s", type=float, default=d.grammar_compile_timeout_s,
                        metavar="S", help="the longest one structured-output grammar (response_format json_schema, "
                        "a required or named tool call) may compile; over it the compile is stopped and the "
                        f"request gets a 400 (default: {d.grammar_compile_timeout_s:g})")
    parser.add_argument("--grammar-compile-workers", type=int, default=d.grammar_compile_workers, metavar="N",
                        help="grammar compile worker processes, shared by tenants round-robin with one compile "
                        "each at a time; 2 or more keep one tenant's slow grammar from delaying another's "
                        f"(default: {d.grammar_compile_workers})")
    if with_threads:
        parser.add_argument("--threads", type=int, default=None, metavar="N",
                            help="CPU threads torch uses in the engine (default: torch's own, one per core); "
                                 "on a host shared with other work fewer threads can be much faster")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=ns.model, dtype=ns.dtype, quantization=ns.quantization, max_model_len=ns.max_model_len,
        kv_cache_tokens=ns.kv_cache_tokens,
        kv_cache_memory=ns.kv_cache_memory, kv_headroom=ns.kv_headroom, page_size=ns.page_size,
        max_num_batched_tokens=ns.max_num_batched_tokens, max_num_seqs=ns.max_num_seqs,
        max_prefill_chunk_tokens=ns.max_prefill_chunk_tokens, fair_share_tokens=ns.fair_share_tokens,
        kv_scrub=ns.kv_scrub, check_kv=ns.check_kv,
        enable_prefix_caching=ns.enable_prefix_caching, seed=ns.seed, num_threads=ns.threads, native=ns.native,
        grammar_compile_timeout_s=ns.grammar_compile_timeout_s, grammar_compile_workers=ns.grammar_compile_workers,
    )
