"""`kvseal` command line: generate, plan, serve, engine, keys, usage, audit, bench, canary."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvseal.auditlog.cli import add_auditlog_parsers
from kvseal.bench.cli import add_bench_parser
from kvseal.canary import add_canary_arguments, cmd_canary
from kvseal.capacity import GpuMemoryPlan, KvCapacity, bytes_per_element, parse_bytes
from kvseal.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineArgs, ModelConfig, default_dtype
from kvseal.disagg.config import EngineKeyFiles, NodeConfig, PdServeArgs, node_config_from
from kvseal.engine.supervisor import RestartPolicy
from kvseal.engine_args import add_engine_arguments, engine_args_from
from kvseal.errors import ConfigError, KvsealError
from kvseal.flags import add_flags, flag, values_of
from kvseal.no_torch import tokenize_without_torch
from kvseal.server import add_serve_arguments
from kvseal.vllm_compat import add_vllm_flags, vllm_notes

if TYPE_CHECKING:
    from kvseal.engine_api import EngineBackend
    from kvseal.server import ServerConfig

logger = logging.getLogger("kvseal")


@dataclass(frozen=True)
class GenerateArgs:
    """`kvseal generate`'s own flags (the engine's are `EngineArgs`')."""

    prompt: str = field(metadata=flag("the prompt to complete (with --chat: the user message)", name="prompt"))
    max_tokens: int = field(default=64, metadata=flag("tokens to generate at most"))
    temperature: float = field(default=0.0, metadata=flag("sampling temperature; 0 is greedy"))
    sampling_seed: int | None = field(default=None, metadata=flag("the request's sampling seed", type=int))
    top_p: float = field(default=1.0, metadata=flag("sample from the most likely tokens up to this probability mass"))
    top_k: int = field(default=-1, metadata=flag("sample from the k most likely tokens; -1 keeps all"))
    min_p: float = field(default=0.0, metadata=flag(
        "drop the tokens less likely than this times the most likely one; 0 keeps all"))
    min_tokens: int = field(default=0, metadata=flag("tokens to generate before EOS or a stop may end the output"))
    stop: list[str] | None = field(default=None, metadata=flag(
        "a string that ends the output, cut from it (repeat the flag for several)", action="append", metavar="TEXT"))
    ignore_eos: bool = field(default=False, metadata=flag("keep generating past the end-of-sequence token",
                                                          action="store_true"))
    chat: bool = field(default=False, metadata=flag("wrap the prompt in the model's chat template",
                                                    action="store_true"))


@dataclass(frozen=True)
class PlanArgs:
    """`kvseal plan`'s own flags: the model's dimensions without a model, and tensor parallelism. The
    pool's flags are `EngineArgs`' (`PLAN_ENGINE_FLAGS`), with serve's names and defaults."""

    num_layers: int | None = field(default=None, metadata=flag("decoder layers (with --num-kv-heads and "
                                                               "--head-dim, in place of --model)", type=int))
    num_kv_heads: int | None = field(default=None, metadata=flag("KV heads of the whole model", type=int))
    head_dim: int | None = field(default=None, metadata=flag("dimension of one attention head", type=int))
    tp: int = field(default=1, metadata=flag("tensor-parallel ranks (KV heads are split across them)",
                                             aliases=("--tensor-parallel-size", "-tp")))
    pd_role: bool = field(default=False, metadata=flag(
        "plan a PD role's engine (kvseal engine --role prefill|decode): with --tp above 1 its rank 0 also "
        "stages full pages (every KV head) for the wire, and on the CPU the KV memory pays for them",
        action="store_true"))
    gpu_memory: str | None = field(default=None, metadata=flag(
        "with --device cuda: the GPU's free memory at start-up (e.g. 80GiB, 141GB); the pool is what "
        "--gpu-memory-utilization of it leaves after the weights and the activation peak", metavar="BYTES"))
    activation_memory: str | None = field(default=None, metadata=flag(
        "with --device cuda: the activation peak to plan for (the engine measures it with a profiling forward); "
        "default: an estimate from the model and --max-num-batched-tokens", metavar="BYTES"))


PLAN_ENGINE_FLAGS = ("model", "dtype", "kv_cache_memory", "kv_cache_tokens", "max_model_len", "page_size",
                     "kv_headroom", "device", "gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs")
# `--dtype auto` picks by the serving host's CPU, which plan cannot see: it says what it assumes.
PLAN_AUTO_DTYPE = "bfloat16"
PLAN_AUTO_WHY = ("auto: plan cannot probe the serving host's CPU; it assumes bfloat16, what auto picks on CPUs "
                 "with AVX512-BF16 or AMX (elsewhere auto picks float32: twice the bytes per token, half the "
                 "pool; pass --dtype float32 to plan for that)")


def _cmd_generate(ns: argparse.Namespace) -> int:
    from kvseal.llm import LLM
    from kvseal.types import SamplingParams

    # the request's flags are checked before the model loads
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, seed=ns.sampling_seed,
                            top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p, min_tokens=ns.min_tokens,
                            stop=tuple(ns.stop or ()),
                            ignore_eos=ns.ignore_eos)
    llm = LLM(**vars(engine_args_from(ns)))
    if ns.chat:
        out = llm.chat([{"role": "user", "content": ns.prompt}], params)[0]
    else:
        out = llm.generate(ns.prompt, params)[0]
    print(out.text)
    return 0


def _cmd_plan(ns: argparse.Namespace) -> int:
    # serve's own checks of these flags: a bad value is a kvseal: error (exit 2), never a plan
    args = EngineArgs(**{name: getattr(ns, name) for name in PLAN_ENGINE_FLAGS})
    model, source = _plan_model(ns)
    layers, kv_heads, head_dim = (ns.num_layers, ns.num_kv_heads, ns.head_dim) if model is None else \
        (model.num_layers, model.num_kv_heads, model.head_dim)
    on_gpu = ns.device == "cuda"
    dtype = default_dtype("cuda") if on_gpu and ns.dtype == "auto" else PLAN_AUTO_DTYPE if ns.dtype == "auto" \
        else ns.dtype
    cap = KvCapacity.for_dims(layers, kv_heads, head_dim, bytes_per_element(dtype), ns.page_size, ns.tp,
                              ns.pd_role and not on_gpu)
    gpu = _plan_gpu(ns, model, dtype) if on_gpu and not ns.kv_cache_tokens and ns.kv_cache_memory is None else None
    if gpu is not None:
        for name, value in gpu.rows():
            print(f"{name:<33}  {value}")
        try:
            cap = cap.with_memory(gpu.require_room())
        except KvsealError as exc:
            print(f"REFUSED: {exc}")
            return 1
    elif ns.kv_cache_tokens:
        cap = cap.with_tokens(ns.kv_cache_tokens)
    else:
        cap = cap.with_memory(parse_bytes(ns.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY))
    max_model_len, why = _plan_max_model_len(args, model, cap)
    needed = max_model_len * ns.kv_headroom
    per_rank = cap.num_kv_heads_per_rank
    memory = f"{cap.kv_memory_bytes:,} bytes" if cap.kv_memory_bytes is not None else "(from --kv-cache-tokens)"
    rows = [
        ("model", source),
        ("layers x kv_heads/rank x head_dim", f"{layers} x {per_rank} (of {kv_heads}, tp={ns.tp}) x {head_dim}"),
        ("dtype", f"{dtype} ({cap.element_bytes} bytes)"
         + (f"; {PLAN_AUTO_WHY}" if ns.dtype == "auto" and not on_gpu else "")),
        ("KV bytes per token",
         f"2 x {layers} x {per_rank} x {head_dim} x {cap.element_bytes} = {cap.bytes_per_token:,}"),
        ("page", f"{ns.page_size} tokens = {cap.page_bytes:,} bytes"),
        ("KV memory", memory),
        ("pool", f"{cap.num_pages:,} pages = {cap.pool_tokens:,} tokens"),
        *([("PD staging (rank 0)", f"{cap.num_pages:,} pages x {cap.staging_page_bytes:,} bytes (all {kv_heads} KV "
            f"heads) = {cap.staging_bytes:,} bytes; with the pool {cap.num_pages * cap.page_bytes:,} bytes: "
            f"{cap.num_pages * cap.page_bytes + cap.staging_bytes:,} bytes on rank 0")]
          if cap.staging_kv_heads else []),
        ("max_model_len", f"{max_model_len:,} ({why})"),
        ("max_model_len x headroom", f"{max_model_len:,} x {ns.kv_headroom} = {needed:,.0f} tokens"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    try:
        cap.require_fits(max_model_len, ns.kv_headroom)
    except KvsealError as exc:
        print(f"REFUSED: {exc}")
        return 1
    print(f"OK: the pool holds {cap.pool_tokens / max_model_len:.2f} full-length requests")
    return 0


def _plan_gpu(ns: argparse.Namespace, model: ModelConfig | None, dtype: str) -> GpuMemoryPlan:
    """The GPU pool's arithmetic of `--device cuda`, as the engine does it, from the config alone."""
    if ns.gpu_memory is None or (model is None and ns.model is None):
        raise ConfigError("plan --device cuda sizes the pool from the GPU's memory: give --gpu-memory (its free "
                          "memory, e.g. 80GiB) and a model (--model, default serve's; the weights' size comes from "
                          "its config) rather than --num-layers/--num-kv-heads/--head-dim alone, or size the pool "
                          "with --kv-cache-memory or --kv-cache-tokens")
    if model is None:  # the dimensions given, the weights still the model's
        from kvseal.models.loader import plan_config

        model = plan_config(ns.model)
    activation = parse_bytes(ns.activation_memory) if ns.activation_memory is not None else \
        model.activation_estimate(dtype, ns.max_num_batched_tokens, min(ns.max_num_seqs, ns.max_num_batched_tokens))
    return GpuMemoryPlan(parse_bytes(ns.gpu_memory), ns.gpu_memory_utilization, model.weight_bytes(dtype),
                         activation)


def _plan_model(ns: argparse.Namespace) -> tuple[ModelConfig | None, str]:
    """The model serve would load (--model, else the default model), from its config alone, and
    how plan names it; None where all three dimensions are given in its place."""
    explicit = (ns.num_layers, ns.num_kv_heads, ns.head_dim)
    if all(v is not None for v in explicit):
        return None, "(explicit dimensions)"
    if ns.model is None and any(v is not None for v in explicit):
        raise KvsealError("plan needs all of --num-layers, --num-kv-heads and --head-dim, or none of them "
                          "(then --model's, default: the default model)")
    from kvseal.model_files import resolve_model_path
    from kvseal.models.loader import plan_config

    config = plan_config(ns.model)  # serve's model: the same path, the default where --model is not given
    return config, str(ns.model) if ns.model is not None else f"{resolve_model_path(None)} (the default model)"


def _plan_max_model_len(args: EngineArgs, model: ModelConfig | None, cap: KvCapacity) -> tuple[int, str]:
    """max_model_len as serve resolves it (`EngineArgs.resolve_max_model_len`), and where it came from."""
    if model is None:
        if not isinstance(args.max_model_len, int):
            raise ConfigError("plan with --num-layers, --num-kv-heads and --head-dim has no model to take "
                              "max_model_len from (its default, its position limit, auto's clamp): give "
                              "--max-model-len N, or --model in place of the dimensions")
        return args.max_model_len, "--max-model-len"
    resolved = args.resolve_max_model_len(model, cap)
    if args.max_model_len is None:
        return resolved, "the model's max_position_embeddings"
    if args.max_model_len == "auto":
        return resolved, (f"auto: the model allows {model.max_position_embeddings:,}, the pool holds "
                          f"{cap.pool_tokens:,} tokens at kv_headroom {args.kv_headroom}")
    return resolved, "--max-model-len"


def _cmd_serve(ns: argparse.Namespace) -> int:
    from kvseal.server import ServerConfig, bind_listener, serve

    config = ServerConfig.from_namespace(ns)
    restart = RestartPolicy(**values_of(ns, RestartPolicy))  # bad flags stop start-up before anything runs
    for note in vllm_notes(ns):
        logger.info("%s", note)
    args = engine_args_from(ns) if _is_colocated(ns) else None
    # Bound before any engine starts: an address that cannot be listened on fails here, by name.
    with bind_listener(config.host, config.port) as listener:
        if args is None:
            return serve(config, lambda: _engine_backend(ns, restart), listener)
        return _serve_colocated(ns, config, args, restart, listener)


def _serve_colocated(ns: argparse.Namespace, config: ServerConfig, args: EngineArgs, restart: RestartPolicy,
                     listener: socket.socket) -> int:
    """The colocated engine process starts as soon as the flags, keys and audit log are in order:
    its start-up (seconds: torch, the weights, the pool) then overlaps the frontend's own
    imports (transformers, FastAPI) on the other core instead of following them."""
    from kvseal.engine.client import EngineClient
    from kvseal.server import open_front_door, serve

    files = open_front_door(config)
    if ns.own_process:  # a SIGTERM before the server's loop answers it unwinds through the clean-ups below
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with contextlib.ExitStack() as until_served:
        until_served.callback(files.audit.close)
        engine = EngineClient(args, ns.log_level, restart)
        until_served.callback(engine.discard_early)
        engine.start_early()
        if ns.own_process:  # only now: nothing above imports transformers
            tokenize_without_torch()
        until_served.pop_all()  # from here `serve` closes the files
    try:
        return serve(config, lambda: engine, listener, files)
    finally:
        engine.discard_early()  # where the server stopped before taking the engine over


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _engine_backend(ns: argparse.Namespace, restart: RestartPolicy) -> EngineBackend:
    """`serve --pd` (or `--prefill/--decode`)'s engines."""
    from kvseal.disagg.topology import PdTopology

    topology = PdTopology.from_namespace(ns)
    assert topology is not None, "a colocated engine is started by _cmd_serve"
    args = engine_args_from(ns)
    if args.num_threads is not None:
        raise ConfigError("--threads sets the colocated engine's CPU threads; with --pd give "
                          "--pd-threads PREFILL,DECODE, with --prefill/--decode give each "
                          "`kvseal engine` its own --threads")
    from kvseal.disagg.serve import start_pd_backend

    return start_pd_backend(topology, args, ns, restart)


def _cmd_engine(ns: argparse.Namespace) -> int:
    from kvseal.disagg.engine_main import serve_engine

    config = node_config_from(ns)  # its keys first: an engine without them never gets further
    return serve_engine(engine_args_from(ns), config)


def tp_node_args(ns: argparse.Namespace) -> EngineArgs:
    """`kvseal tp-node`'s engine arguments: node 0's flags, and --pd-role where node 0 serves a PD
    role (its pool is then sized with rank 0's staging pool, and every rank holds as many pages)."""
    return replace(engine_args_from(ns), pd_role=ns.pd_role)


def _cmd_tp_node(ns: argparse.Namespace) -> int:
    from kvseal.parallel.node import run_node

    return run_node(tp_node_args(ns))


def _cmd_keys_generate(ns: argparse.Namespace) -> int:
    from kvseal.disagg.link_keys import generate_keys

    for public, secret in generate_keys(ns.dir, ns.names):
        print(f"{public}  (public: give it to whoever must accept this key)")
        print(f"{secret}  (secret, mode 0600: only this key's own process reads it)")
    return 0


def _cmd_keys_tp_key(ns: argparse.Namespace) -> int:
    from kvseal.parallel.tp_key import write_tp_key

    path = write_tp_key(ns.file)
    print(f"{path}  (secret, mode 0600: copy it to every node, give it as --tp-key-file to the engine and "
          f"every `kvseal tp-node`)")
    return 0


def _add_keys_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    keys = sub.add_parser("keys", help="keys of the PD engine links (CURVE) and of multi-node tensor-parallel ranks "
                          "(every link is authenticated)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    generate = keys_sub.add_parser("generate", help="write NAME.key (public) and NAME.key_secret (0600) per name")
    generate.add_argument("--dir", required=True, help="where to write them (made with mode 0700 if missing)")
    generate.add_argument("names", nargs="+", metavar="NAME",
                          help="one key pair per name, e.g. frontend prefill-0 decode-0")
    generate.set_defaults(func=_cmd_keys_generate)
    tp_key = keys_sub.add_parser("tp-key", help="write a tensor-parallel ranks' key (mode 0600) for --tp-key-file "
                                 "(--nnodes > 1); never overwrites a file")
    tp_key.add_argument("file", metavar="FILE", help="where to write it (a new file)")
    tp_key.set_defaults(func=_cmd_keys_tp_key)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvseal", description=__doc__)
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"))
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt offline and print the text")
    add_engine_arguments(gen)
    add_flags(gen, GenerateArgs)
    gen.set_defaults(func=_cmd_generate)

    plan = sub.add_parser("plan", help="print KV capacity arithmetic without loading weights")
    add_flags(plan, EngineArgs, only=PLAN_ENGINE_FLAGS)
    add_flags(plan, PlanArgs)
    plan.set_defaults(func=_cmd_plan)

    serve = sub.add_parser("serve", help="OpenAI-compatible multi-tenant HTTP server")
    add_engine_arguments(serve, model_positional=True)
    add_serve_arguments(serve)
    add_flags(serve.add_argument_group("engine supervision (colocated, and the engines serve --pd starts)"),
              RestartPolicy)
    add_flags(serve.add_argument_group("prefill/decode disaggregation"), PdServeArgs)
    add_flags(serve, NodeConfig, only=("kv_transport", "reservation_timeout_s"))  # with --pd
    add_vllm_flags(serve)
    serve.set_defaults(func=_cmd_serve)

    engine = sub.add_parser("engine", help="one prefill or decode engine for a PD frontend (kvseal serve --prefill)")
    add_engine_arguments(engine)
    add_flags(engine, NodeConfig)
    add_flags(engine, EngineKeyFiles)
    engine.set_defaults(func=_cmd_engine)

    _add_keys_parser(sub)

    add_auditlog_parsers(sub)

    add_bench_parser(sub)

    tp_node = sub.add_parser("tp-node", help="the tensor-parallel ranks of a node other than 0 (--node-rank 1..): "
                             "same flags as node 0's engine")
    add_engine_arguments(tp_node, model_positional=True)
    tp_node.add_argument("--pd-role", action="store_true",
                         help="node 0 runs a PD role (kvseal engine --role ... -tp N): size the pool as it does, "
                              "with its rank 0's staging pool inside the same KV memory")
    tp_node.set_defaults(func=_cmd_tp_node)

    canary = sub.add_parser("canary", help="tenant-isolation canary run against an OpenAI-compatible server")
    add_canary_arguments(canary)
    canary.set_defaults(func=cmd_canary)
    return parser


def _is_colocated(ns: argparse.Namespace) -> bool:
    return ns.command == "serve" and not (ns.pd or ns.prefill or ns.decode)


def _runs_no_model(ns: argparse.Namespace) -> bool:
    """Commands whose process only tokenizes or talks HTTP: bench, canary, and the colocated
    frontend (its engine is a child process; a PD frontend converts a GGUF for its tokenizer)."""
    return _is_colocated(ns) or ns.command in ("bench", "canary")


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    ns.own_process = argv is None  # this process is the command's own, not a caller's (tests)
    if ns.own_process and _runs_no_model(ns) and not _is_colocated(ns):  # the colocated frontend: in _cmd_serve
        tokenize_without_torch()
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(ns.func(ns))
    except KvsealError as exc:
        print(f"kvseal: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
