"""Frozen configuration, one dataclass per layer, validated on construction.

`EngineArgs` is what a user gives (it may say "auto"); `resolve()` turns it into frozen
`ModelConfig`, `CacheConfig` and `SchedulerConfig` with every "auto" decided, and refuses a
configuration the server cannot honour (I2).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import math
import socket
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvseal.capacity import (
    ELEMENT_BYTES,
    KvCapacity,
    bytes_per_element,
    check_headroom,
    estimate_activation_bytes,
    parse_bytes,
    weight_bytes,
)
from kvseal.errors import ConfigError, ModelLoadError
from kvseal.flags import flag, flag_fields, flag_name

if TYPE_CHECKING:  # configuration is read without torch (the frontend, `kvseal plan`)
    import torch

logger = logging.getLogger("kvseal")

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
ScrubMode = Literal["off", "free", "alloc"]
# The engine's kernels (`kvseal.ops.select_ops`): "auto" the native kernels if they build, else
# the torch ops; "require" the native kernels or start-up fails; "off" the torch ops.
NativeMode = Literal["auto", "require", "off"]
NATIVE_MODES = ("auto", "require", "off")
# Where the engine runs (`kvseal.ops.device.resolve_device`): "auto" CUDA when torch sees a GPU.
DEVICES = ("auto", "cpu", "cuda")
# The attention kernels: "auto" the device's own (native or torch on CPU, per --native; Triton on
# CUDA); "triton" the Triton kernels on any device (on CPU only under TRITON_INTERPRET=1: tests).
ATTENTION_BACKENDS = ("auto", "triton")
DEFAULT_CPU_KV_CACHE_MEMORY = "2GiB"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_MAX_PREFILL_CHUNK_TOKENS = 512  # a quarter of the default step budget
DEFAULT_FAIR_SHARE_TOKENS = 256  # an eighth of the default step budget
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 5.0
DEFAULT_TP_TIMEOUT_S = 60.0  # a collective that waits this long for a rank: the rank is gone or hung
DEFAULT_GRAMMAR_COMPILE_WORKERS = 2
# Most CPU threads (--threads, --pd-threads) or grammar compile workers one engine may ask for:
# far past any host's cores, and below the counts at which OpenMP's thread pool crashes the process.
MAX_NUM_THREADS = 1024
DTYPES = tuple(ELEMENT_BYTES)  # the names `--dtype` takes (after "auto" is resolved)
# Weight-only: "int8": per-output-channel int8 linears (kvseal.models.quant); "bf16": a float32
# model whose linear weights are stored in bfloat16 and widened as they are read (half the bytes,
# float32 arithmetic; kvseal.models.packed, needs the native kernels).
QUANTIZATIONS = ("none", "int8", "bf16")


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder, normalized once from a Hugging Face config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    has_qk_norm: bool
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None
    hf_config: Any = field(compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    def attention_cost_context(self, dtype: torch.dtype | str) -> int:
        """The context length at which one token's attention costs what its linear layers cost.

        A token at context c costs about 1 + c / this, in tokens of linear work: the ratio of
        the linears' multiply-adds per token to attention's per (query, key) pair (q·k and p·v,
        every head). 16-bit models divide it by 2: their linears run at twice float32's rate
        (VDPBF16PS, AMX) while P·V stays in float32 (measured on SmolLM2-135M in bf16 on
        AVX512-BF16: 1,564 against this formula's 1,536; float32 on AVX2: ~3,950 against 3,072).
        """
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        linear = self.hidden_size * (2 * q_out + 2 * kv_out) + 3 * self.hidden_size * self.intermediate_size
        pair = 2 * self.num_heads * self.head_dim
        is_float32 = str(dtype).removeprefix("torch.") == "float32"
        return max(1, round(linear / pair / (1 if is_float32 else 2)))

    def weight_bytes(self, dtype: str) -> int:
        """The bytes of the model's parameters in `dtype` (what the engine's model holds), from
        the config alone (`kvseal plan`)."""
        return weight_bytes(self.vocab_size, self.hidden_size, self.intermediate_size, self.num_layers, self.num_heads,
                            self.num_kv_heads, self.head_dim, bytes_per_element(dtype), self.tie_word_embeddings,
                            self.attention_bias, self.has_qk_norm,
                            self.attention_bias and self.architecture != "Qwen2ForCausalLM")

    def activation_estimate(self, dtype: str, num_tokens: int, num_seqs: int) -> int:
        """`kvseal plan`'s estimate of a step's activation peak (the engine measures it)."""
        return estimate_activation_bytes(num_tokens, self.hidden_size, self.intermediate_size, self.num_heads,
                                         self.num_kv_heads, self.head_dim, self.vocab_size, num_seqs,
                                         bytes_per_element(dtype))

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        architecture = _architecture_of(hf)
        num_heads = hf.num_attention_heads
        eos = hf.eos_token_id
        window = getattr(hf, "sliding_window", None)
        if architecture == "Qwen2ForCausalLM" and not getattr(hf, "use_sliding_window", False):
            window = None
        return cls(
            architecture=architecture,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=architecture == "Qwen2ForCausalLM" or bool(getattr(hf, "attention_bias", False)),
            has_qk_norm=architecture == "Qwen3ForCausalLM",
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            sliding_window=window,
            hf_config=hf,
        )


def _architecture_of(hf: Any) -> str:
    names = list(getattr(hf, "architectures", None) or [])
    if not names:
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                   "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        names = [by_type.get(getattr(hf, "model_type", ""), getattr(hf, "model_type", "?"))]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ModelLoadError(
        f"unsupported architecture {names}; kvseal supports {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


@dataclass(frozen=True)
class CacheConfig:
    page_size: int
    num_pages: int
    dtype: torch.dtype
    kv_scrub: ScrubMode = "off"
    check_kv: bool = False
    enable_prefix_caching: bool = True  # per-tenant prefix cache (I5)
    device: str = "cpu"  # where the pool and its write records live: "cpu" or "cuda"

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"the KV cache's device must be cpu or cuda, got {self.device!r}")
        if self.page_size < 1 or self.num_pages < 1:
            raise ConfigError(f"page_size ({self.page_size}) and num_pages ({self.num_pages}) must be >= 1")
        if self.kv_scrub not in ("off", "free", "alloc"):
            raise ConfigError(f"kv_scrub must be one of off, free, alloc; got {self.kv_scrub!r}")

    @property
    def kv_cache_tokens(self) -> int:
        return self.page_size * self.num_pages

    @property
    def scrub_policy(self) -> str:
        """What overwrites a page between owners (I7): "off" (nothing: the next owner's writes),
        "free" or "alloc" (zeroed then), or "checked" (`check_kv`: NaN while free, zeroed on
        hand-out, whatever `kv_scrub` says)."""
        return "checked" if self.check_kv else self.kv_scrub


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_prefill_chunk_tokens: int  # most prefill tokens one request gets in one step
    # While other tenants have requests in flight, the most prefill work a tenant other than the
    # one with the least prefill left gets in one step, in token-equivalents (attention counted).
    fair_share_tokens: int = DEFAULT_FAIR_SHARE_TOKENS
    attention_cost_context: int = 4096  # ModelConfig.attention_cost_context of the served model

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "max_prefill_chunk_tokens",
                     "fair_share_tokens", "attention_cost_context"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prefill_chunk_tokens > self.max_num_batched_tokens:
            raise ConfigError(f"max_prefill_chunk_tokens={self.max_prefill_chunk_tokens} exceeds "
                              f"max_num_batched_tokens={self.max_num_batched_tokens}; a chunk must fit in one "
                              f"step's budget: set it <= {self.max_num_batched_tokens}, or leave it unset "
                              f"(512, or the budget if smaller)")


@dataclass(frozen=True)
class GrammarConfig:
    """Structured-output grammar compiles: each runs in one of `num_workers` worker processes
    (tenants served round-robin, one compile each at a time) and is stopped once it has used
    `compile_timeout_s` seconds of its worker's CPU time, the request refused with a 400 (or has
    waited thirty times that on a host too busy to give it the CPU: a 503)."""

    compile_timeout_s: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S
    num_workers: int = DEFAULT_GRAMMAR_COMPILE_WORKERS

    def __post_init__(self) -> None:
        timeout = self.compile_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < float("inf"):
            raise ConfigError(f"--grammar-compile-timeout-s (grammar_compile_timeout_s) must be a number of seconds "
                              f"> 0, got {timeout!r}; it is the CPU time one structured-output grammar may take to "
                              f"compile "
                              f"(default {DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S:g})")
        workers = self.num_workers
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_NUM_THREADS:
            raise ConfigError(f"--grammar-compile-workers (grammar_compile_workers) must be a whole number from 1 to "
                              f"{MAX_NUM_THREADS}, got {workers!r}; with 2 or more, one tenant's slow grammar never "
                              f"holds up another's (default {DEFAULT_GRAMMAR_COMPILE_WORKERS})")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `DTYPES` name (imports torch: engine side only)."""
    import torch

    return getattr(torch, name)  # type: ignore[no-any-return]


def cpu_has_native_bf16() -> bool:
    """True on CPUs with AVX512-BF16 or AMX-BF16, where bf16 matmuls run several times faster."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


_DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
                  "fp16": "float16", "float16": "float16", "half": "float16"}


def check_field_types(config: Any) -> None:
    """ConfigError naming the first init field of the dataclass `config` whose value is not of its
    annotated type (ints, numbers, booleans, strings, literals and their unions; a bool is not a
    number): `LLM(page_size="16")`, `enable_prefix_caching="no"` or `max_model_len=128.5` are
    refused by name, not run as something else or failed deep inside."""
    hints = typing.get_type_hints(type(config))
    for field_ in dataclasses.fields(config):
        if field_.init and not _fits(value := getattr(config, field_.name), hints[field_.name]):
            named = f"{field_.name} ({flag_name(field_)})" if field_ in flag_fields(type(config)) else field_.name
            raise ConfigError(f"{named} must be {_described(hints[field_.name])}; got {value!r}")


def _fits(value: Any, hint: Any) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, part) for part in typing.get_args(hint))
    if typing.get_origin(hint) is Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True  # a type this check does not know: the field's own checks decide


def _described(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_described(part) for part in typing.get_args(hint))
    if typing.get_origin(hint) is Literal:
        return " or ".join(repr(v) for v in typing.get_args(hint))
    return {type(None): "None", bool: "true or false", int: "an integer", float: "a number",
            str: "a string"}.get(hint, getattr(hint, "__name__", str(hint)))


def default_dtype(device: str) -> str:
    """What `--dtype auto` means on `device`: bfloat16 on CUDA; on the CPU (and for "auto" until
    the engine decides the device) bfloat16 where the CPU multiplies it natively, else float32."""
    if device == "cuda":
        return "bfloat16"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def dtype_arg(value: str) -> str:
    """`--dtype`: auto, or a dtype name or alias (bf16, fp32, ...) turned into its `DTYPES` name."""
    if value == "auto":
        return value
    if value not in _DTYPE_ALIASES:
        raise argparse.ArgumentTypeError(f"dtype must be auto or one of {', '.join(_DTYPE_ALIASES)}")
    return _DTYPE_ALIASES[value]


def max_model_len_arg(value: str) -> int | str:
    """`--max-model-len`: a whole number of tokens, or auto."""
    return "auto" if value == "auto" else int(value)


@dataclass(frozen=True)
class EngineArgs:
    """What the user asks for. Values may be "auto"/None; `resolve()` decides them.

    Each field is also the command-line flag of `serve`, `engine` and `generate` (and, where it
    applies, `plan`), and a keyword of `LLM(...)`: see `kvseal.flags`.
    """

    model: str | None = field(default=None, metadata=flag(
        "local model folder (config.json, *.safetensors, tokenizer) or .gguf file (default: SmolLM2-135M)"))
    tokenizer: str | None = field(default=None, metadata=flag(
        "a local folder holding the tokenizer to use instead of the model's (vLLM's --tokenizer; e.g. the base "
        "model's for a .gguf file); its vocabulary must fit the model's", metavar="FOLDER"))
    dtype: str = field(default="auto", metadata=flag(
        "float32, bfloat16 or float16 (bf16, fp32 ...); auto: bfloat16 on CUDA, and on CPU where it multiplies "
        "bf16 natively (AVX512-BF16 or AMX), else float32", type=dtype_arg))
    quantization: str = field(default="none", metadata=flag(
        f"weight-only quantization of the linear layers: {', '.join(QUANTIZATIONS)} (default: none); the "
        f"activations and KV cache stay in --dtype"))  # checked in __post_init__, with what each one does
    max_model_len: int | Literal["auto"] | None = field(default=None, metadata=flag(
        "context window in tokens, or auto (clamped to the KV pool); default: the model's",
        type=max_model_len_arg))
    kv_cache_tokens: int | None = field(default=None, metadata=flag(
        "KV pool size in tokens (rounded up to whole pages)", type=int))
    kv_cache_memory: str | int | None = field(default=None, metadata=flag(
        "KV pool budget per rank when --kv-cache-tokens is not given (e.g. 2GiB, 64GiB); default: "
        f"{DEFAULT_CPU_KV_CACHE_MEMORY} on CPU, on CUDA what --gpu-memory-utilization leaves",
        deprecated=("--kv-memory",)))
    gpu_memory_utilization: float = field(default=DEFAULT_GPU_MEMORY_UTILIZATION, metadata=flag(
        "on CUDA, the fraction of the device's free memory at start-up the engine may use: the KV pool gets what "
        "is left of it after the weights and the activation peak of a profiling forward (unless "
        f"--kv-cache-memory or --kv-cache-tokens size it); default {DEFAULT_GPU_MEMORY_UTILIZATION}"))
    device: str = field(default="auto", metadata=flag(
        "where the engine runs: auto (CUDA when torch sees a GPU, else the CPU), cpu, or cuda (start-up fails "
        "without a GPU)", choices=DEVICES))
    attention_backend: str = field(default="auto", metadata=flag(
        "the attention kernels: auto (the device's: kvseal's native or torch's on CPU per --native, Triton on CUDA) "
        "or triton (the Triton kernels on any device; on CPU only under Triton's interpreter, TRITON_INTERPRET=1, "
        "which is for tests)", choices=ATTENTION_BACKENDS))
    kv_headroom: float = field(default=1.0, metadata=flag(
        "the pool must hold max_model_len x this many tokens, or start-up fails (I2)"))
    page_size: int = field(default=16, metadata=flag("tokens per KV page (vLLM's --block-size)",
                                                     aliases=("--block-size",)))
    max_num_batched_tokens: int = field(default=2048, metadata=flag(
        "token budget of one step (prefill chunks + decodes)"))
    max_num_seqs: int = field(default=256, metadata=flag("running requests at most"))
    # None: 512, or the whole budget if smaller
    max_prefill_chunk_tokens: int | None = field(default=None, metadata=flag(
        "most prefill tokens one request gets per step, so other requests and tenants share the budget "
        "(default: 512, or --max-num-batched-tokens if smaller)", type=int))
    fair_share_tokens: int = field(default=DEFAULT_FAIR_SHARE_TOKENS, metadata=flag(
        "while other tenants have requests in flight, the most prefill work (in tokens; a token deep in a long "
        "prompt counts for more, by its attention) a tenant gets in one step, unless it has the least prefill "
        f"left: keeps steps short while another tenant waits (default: {DEFAULT_FAIR_SHARE_TOKENS})"))
    kv_scrub: ScrubMode = field(default="off", metadata=flag(
        "zero KV pages when freed (free) or when handed out (alloc); off: the next owner's writes (I7)",
        choices=("off", "free", "alloc")))
    check_kv: bool = field(default=False, metadata=flag(
        "checked mode: NaN-poison freed pages and verify every read slot was written by its reader (I4)",
        action="store_true"))
    # reuse full KV pages of earlier prompts of the same tenant (I5)
    enable_prefix_caching: bool = field(default=True, metadata=flag(
        "the prefix cache, per tenant (I5): on by default; --no-prefix-caching (or vLLM's "
        "--no-enable-prefix-caching) prefills every prompt in full", name="--enable-prefix-caching",
        action=argparse.BooleanOptionalAction, aliases=("--prefix-caching",)))
    # torch's global seed; unseeded requests draw their own from the OS, never from this
    seed: int = field(default=0, metadata=flag("torch's global seed (unseeded requests draw from the OS)"))
    # torch's intra-op CPU threads in the engine process, set before the model loads; None keeps
    # torch's default (one per core). A host shared with the frontend or other work may do better
    # with fewer: OpenMP workers wait at every op's barrier for a thread that is off-CPU.
    num_threads: int | None = field(default=None, metadata=flag(
        "CPU threads torch uses in the engine (default: torch's own, one per core); on a host shared with other "
        "work fewer can be much faster (serve --pd: --pd-threads)", name="--threads", type=int, metavar="N"))
    # the kernels: the native ones built for this CPU at first start ("auto": if they build, else
    # torch's; "require": or start-up fails with the compiler's message) or torch's ("off")
    native: NativeMode = field(default="auto", metadata=flag(
        "the engine's kernels: auto (kvseal's native kernels, built with the C compiler ($CC, else cc) at first "
        "start and cached, or torch's ops if they cannot be built), require (the native kernels, or start-up "
        "fails with the compiler's message), off (torch's ops); default auto", choices=NATIVE_MODES))
    # One-row steps of a bfloat16 model from a GGUF read the file's blocks where it holds them
    # so: the decoder linears' where every one is Q4_1 (csrc/linear_q4.c), the lm_head's where it
    # is Q8_0 (csrc/linear_q8.c), each on its own; bit-equal to the bfloat16 weights' tiles. Off:
    # the bfloat16 weights serve every step (the A/B of bench/). Named when it was Q4_1 alone;
    # --gguf-block-rows says what it covers now.
    gguf_q4_rows: bool = field(default=True, metadata=flag(
        "single-row decode steps of a bfloat16 model loaded from a .gguf read the file's quantized blocks instead "
        "of the bfloat16 weights: the decoder linears' where all of them are Q4_1, the lm_head's where it is Q8_0 "
        "(the same sums, bit for bit; CPUs whose bfloat16 linears run on AVX512-BF16 dot products, not AMX): on by "
        "default; --no-gguf-q4-rows (or --no-gguf-block-rows) reads the bfloat16 weights for both",
        action=argparse.BooleanOptionalAction, aliases=("--gguf-block-rows",)))
    # Structured output: how long one grammar may compile before the request is refused, and
    # how many worker processes compile (GrammarConfig).
    grammar_compile_timeout_s: float = field(default=DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, metadata=flag(
        "the CPU time one structured-output grammar (response_format json_schema, a required or named tool call) "
        "may take to compile (a compile also waits at most thirty times this on a busy host); over it the compile is "
        "stopped and the request gets a 400 "
        f"(default: {DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S:g})", metavar="S"))
    grammar_compile_workers: int = field(default=DEFAULT_GRAMMAR_COMPILE_WORKERS, metadata=flag(
        "grammar compile worker processes, shared by tenants round-robin with one compile each at a time; 2 or "
        f"more keep one tenant's slow grammar from delaying another's (default: {DEFAULT_GRAMMAR_COMPILE_WORKERS})",
        metavar="N"))
    # Tensor parallelism (kvseal/parallel): this many ranks, one process each, over torch.distributed
    tensor_parallel_size: int = field(default=1, metadata=flag(
        "tensor-parallel ranks: one process each (this one is rank 0), attention heads, KV heads, MLP and "
        "vocabulary split across them over torch.distributed (gloo on CPU; nccl on CUDA, one GPU a rank); "
        "default 1", aliases=("-tp",), metavar="N"))
    tp_timeout_s: float = field(default=DEFAULT_TP_TIMEOUT_S, metadata=flag(
        "the longest one tensor-parallel collective (a step's message, a forward's all-reduce) may wait for a "
        "rank (start-up, loading the shards: at least 300 s); past it the engine fails closed: every in-flight "
        "request ends with an error "
        f"(default: {DEFAULT_TP_TIMEOUT_S:g})", name="--tp-timeout", metavar="S"))
    # whether `dtype` was given as auto and decided here for the device (`on_device` decides it
    # again once an "auto" device is known); not a flag. An init field so that arguments copied
    # field by field (`EngineArgs(**vars(args))`, `dataclasses.replace`) keep it.
    is_auto_dtype: bool = field(default=False, repr=False, compare=False)
    # whether this engine serves a PD role (`kvseal engine --role`, `EngineNode`): under tensor
    # parallelism its rank 0 then holds a staging pool of full pages in host memory, which a CPU
    # engine's KV budget pays for (`capacity.KvCapacity`; on CUDA the budget is the GPU's and the
    # staging pool lies outside it); not a flag (the role's entry point sets it). An init field
    # for the same reason as is_auto_dtype.
    pd_role: bool = field(default=False, repr=False, compare=False)
    # Where the ranks meet (several nodes: torch.distributed's TCP store on rank 0's node; one node:
    # a file store in a private folder) and how many nodes hold them; nodes other than 0 run
    # `kvseal tp-node` with the same flags and their --node-rank
    master_addr: str = field(default="127.0.0.1", metadata=flag(
        "the address the tensor-parallel ranks connect over (default 127.0.0.1: one node); with --nnodes > 1 "
        "the address rank 0 listens on, one the other nodes reach"))
    master_port: int = field(default=0, metadata=flag(
        "with --nnodes > 1 the port rank 0 listens on for the other ranks (one node: unused, its ranks meet in "
        "a file store in a private folder)", metavar="PORT"))
    nnodes: int = field(default=1, metadata=flag(
        "nodes the tensor-parallel ranks are spread over, tensor_parallel_size / nnodes ranks each", metavar="N"))
    node_rank: int = field(default=0, metadata=flag(
        "this node's index (0: the engine, with ranks 0..; others: `kvseal tp-node`)", metavar="I"))
    # The ranks' shared key across nodes (kvseal/parallel/tp_key.py); one node makes a fresh one
    tp_key_file: str | None = field(default=None, metadata=flag(
        "with --nnodes > 1 (required): the key every tensor-parallel rank proves before the group carries "
        "anything, the same file on every node, mode 0600 (`kvseal keys tp-key FILE` writes one); one node makes "
        "a fresh key at every start", metavar="PATH"))

    def __post_init__(self) -> None:
        if type(self.dtype).__name__ == "dtype" and str(self.dtype).startswith("torch."):  # LLM(dtype=torch.bfloat16)
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if isinstance(self.dtype, str) and self.dtype in _DTYPE_ALIASES:  # bf16, fp32, half, ... as --dtype takes
            object.__setattr__(self, "dtype", _DTYPE_ALIASES[self.dtype])
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}; got {self.device!r} (auto: CUDA when "
                              f"torch sees a GPU, else the CPU)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got "
                              f"{self.attention_backend!r}")
        if self.dtype == "auto":  # `on_device` decides again once an "auto" device is known
            object.__setattr__(self, "is_auto_dtype", True)
            object.__setattr__(self, "dtype", default_dtype(self.device))
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be auto or one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r} "
                              f"(int8: weight-only, per-output-channel int8 linear layers; bf16: linear "
                              f"weights stored in bfloat16, float32 arithmetic)")
        if self.quantization == "bf16" and self.dtype != "float32":
            raise ConfigError(f"quantization bf16 stores a float32 model's linear weights in bfloat16; it needs "
                              f"dtype float32, got {self.dtype!r} (a bfloat16 model's weights are bfloat16 already)")
        object.__setattr__(self, "kv_headroom", check_headroom(self.kv_headroom))
        if self.tokenizer is not None and not (isinstance(self.tokenizer, str) and Path(self.tokenizer).is_dir()):
            raise ConfigError(f"--tokenizer must be a local folder holding a tokenizer (tokenizer.json or "
                              f"tokenizer_config.json); {self.tokenizer!r} is not a folder (no model hub is read)")
        if isinstance(self.max_model_len, str) and self.max_model_len != "auto":
            raise ConfigError(f"max_model_len must be an integer or 'auto'; got {self.max_model_len!r}")
        if isinstance(self.max_model_len, int) and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}; give the context length "
                              f"in tokens, or 'auto' to fit it to the KV pool")
        if self.kv_cache_tokens is not None and (isinstance(self.kv_cache_tokens, bool) or
                                                 not isinstance(self.kv_cache_tokens, int) or self.kv_cache_tokens < 1):
            raise ConfigError(f"kv_cache_tokens must be a whole number of tokens >= 1, got {self.kv_cache_tokens!r}; "
                              f"give at least max_model_len tokens, or leave it unset to size the pool from "
                              f"kv_cache_memory")
        if self.max_prefill_chunk_tokens is not None and (isinstance(self.max_prefill_chunk_tokens, bool) or
                                                          not isinstance(self.max_prefill_chunk_tokens, int)):
            raise ConfigError(f"max_prefill_chunk_tokens must be a whole number of tokens, got "
                              f"{self.max_prefill_chunk_tokens!r}; leave it unset for the default "
                              f"(512, or the budget if smaller)")
        if isinstance(self.fair_share_tokens, bool) or not isinstance(self.fair_share_tokens, int) \
                or self.fair_share_tokens < 1:
            raise ConfigError(f"fair_share_tokens must be a whole number of tokens >= 1, got "
                              f"{self.fair_share_tokens!r}; it is the most prefill work a tenant gets in a step "
                              f"while other tenants wait (default {DEFAULT_FAIR_SHARE_TOKENS})")
        if self.num_threads is not None and (isinstance(self.num_threads, bool) or not isinstance(self.num_threads, int)
                                             or not 1 <= self.num_threads <= MAX_NUM_THREADS):
            raise ConfigError(f"--threads (num_threads) must be a whole number from 1 to {MAX_NUM_THREADS}, got "
                              f"{self.num_threads!r}; more threads than cores only wait on each other, so leave it "
                              f"unset for torch's default (one per core)")
        if self.native not in NATIVE_MODES:
            raise ConfigError(f"native must be one of {', '.join(NATIVE_MODES)}; got {self.native!r} (auto: kvseal's "
                              f"native kernels where they build, else torch's ops; require: the native kernels or "
                              f"start-up fails; off: torch's ops)")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size (-tp) must be a whole number >= 1, got "
                              f"{self.tensor_parallel_size!r}; 1 runs the model in one process")
        if isinstance(self.tp_timeout_s, bool) or not isinstance(self.tp_timeout_s, (int, float)) \
                or not math.isfinite(self.tp_timeout_s) or self.tp_timeout_s <= 0:
            raise ConfigError(f"--tp-timeout must be a number of seconds > 0, got {self.tp_timeout_s!r} "
                              f"(default {DEFAULT_TP_TIMEOUT_S:g})")
        self._check_nodes()
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)  # a malformed or negative size fails here, by name
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, int | float) or not 0 < utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be a fraction in (0, 1], got {utilization!r}; it is "
                              f"the share of the GPU's free memory the engine may use (default "
                              f"{DEFAULT_GPU_MEMORY_UTILIZATION})")
        _ = self.grammar_config  # a bad compile timeout or worker count fails here, by flag
        check_field_types(self)  # the fields the checks above do not name (theirs say more)
        for name in ("page_size", "max_num_batched_tokens", "max_num_seqs"):  # checked again where each is used
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.model is not None and not self.model.strip():
            raise ConfigError("model is empty: give a local model folder or .gguf file, or leave it out for the "
                              "default model")

    def on_device(self, device: str) -> EngineArgs:
        """These arguments with the device decided ("cpu" or "cuda"); a dtype given as auto is
        decided again for it (bfloat16 on CUDA)."""
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"on_device takes cpu or cuda, got {device!r}")
        return dataclasses.replace(self, device=device, dtype="auto" if self.is_auto_dtype else self.dtype)

    def _check_nodes(self) -> None:
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1 or tp % nnodes:
            raise ConfigError(f"--nnodes must be a whole number >= 1 that divides --tensor-parallel-size {tp}, got "
                              f"{nnodes!r}: each node runs tensor_parallel_size / nnodes ranks")
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) \
                or not 0 <= self.node_rank < nnodes:
            raise ConfigError(f"--node-rank must be in 0..{nnodes - 1} (--nnodes {nnodes}), got {self.node_rank!r}")
        if isinstance(self.master_port, bool) or not isinstance(self.master_port, int) \
                or not 0 <= self.master_port < 65536:
            raise ConfigError(f"--master-port must be a TCP port (0..65535), got {self.master_port!r}")
        if nnodes > 1 and self.master_port == 0:
            raise ConfigError("--nnodes > 1 needs --master-port: every node must know where rank 0 listens")
        if nnodes > 1 and self.tp_key_file is None:
            raise ConfigError("--nnodes > 1 needs --tp-key-file: every rank proves it holds that key before it gets "
                              "any step, so a process that reaches --master-port is not a rank; make one with "
                              "`kvseal keys tp-key FILE` and copy it (mode 0600) to every node")
        if not self.master_addr or is_wildcard(self.master_addr):
            raise ConfigError(f"--master-addr must name one address rank 0 listens on, got {self.master_addr!r}; "
                              f"a wildcard would take rank connections on every interface")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def grammar_config(self) -> GrammarConfig:
        return GrammarConfig(self.grammar_compile_timeout_s, self.grammar_compile_workers)

    @property
    def resolved_max_prefill_chunk_tokens(self) -> int:
        """The per-request prefill chunk cap: as given, or 512 tokens (the budget if that is smaller)."""
        if self.max_prefill_chunk_tokens is not None:
            return self.max_prefill_chunk_tokens
        return min(DEFAULT_MAX_PREFILL_CHUNK_TOKENS, self.max_num_batched_tokens)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def is_pool_sized_by_device(self) -> bool:
        """Whether the KV pool is what the GPU's memory leaves (CUDA, neither --kv-cache-tokens
        nor --kv-cache-memory given): the engine measures it (`kvseal.capacity.GpuMemoryPlan`)."""
        return self.device == "cuda" and self.kv_cache_tokens is None and self.kv_cache_memory is None

    def capacity(self, model: ModelConfig, kv_memory_bytes: int | None = None) -> KvCapacity:
        """The pool: --kv-cache-tokens, else --kv-cache-memory, else `kv_memory_bytes` (what the
        GPU's memory leaves, measured by the engine; the CPU default where none is given)."""
        return self.capacity_for(model.num_layers, model.num_kv_heads, model.head_dim, kv_memory_bytes)

    def capacity_for(self, num_layers: int, num_kv_heads: int, head_dim: int,
                     kv_memory_bytes: int | None = None) -> KvCapacity:
        """`capacity` from the three dimensions it depends on (torch-free callers that have no
        `ModelConfig`: the engine process's early pool reservation, `kvseal.kvcache.reserve`)."""
        per_elem = bytes_per_element(self.dtype)
        base = KvCapacity.for_dims(num_layers, num_kv_heads, head_dim, per_elem, self.page_size,
                                   self.tensor_parallel_size, self.pd_role and self.device == "cpu")
        if self.kv_cache_tokens is not None:
            return base.with_tokens(self.kv_cache_tokens)
        if self.kv_cache_memory is not None:
            return base.with_memory(parse_bytes(self.kv_cache_memory))
        if kv_memory_bytes is not None:
            return base.with_memory(kv_memory_bytes)
        return base.with_memory(parse_bytes(DEFAULT_CPU_KV_CACHE_MEMORY))

    def resolve(self, model: ModelConfig, kv_memory_bytes: int | None = None) -> tuple[CacheConfig, SchedulerConfig]:
        """Decide every "auto" and refuse what cannot be honoured (I2). `kv_memory_bytes`: the
        pool's bytes when the device's memory sizes it (`is_pool_sized_by_device`)."""
        capacity = self.capacity(model, kv_memory_bytes)
        max_model_len = self.resolve_max_model_len(model, capacity)
        capacity.require_fits(max_model_len, self.kv_headroom)
        # an undecided device (torch-free callers: `kvseal plan`, tests) plans for the CPU; the
        # engine decides it first (`on_device`)
        cache = CacheConfig(self.page_size, capacity.num_pages, self.torch_dtype, self.kv_scrub, self.check_kv,
                            self.enable_prefix_caching, "cpu" if self.device == "auto" else self.device)
        sched = SchedulerConfig(max_model_len, self.max_num_batched_tokens, self.max_num_seqs,
                                self.resolved_max_prefill_chunk_tokens, self.fair_share_tokens,
                                model.attention_cost_context(self.dtype))
        return cache, sched

    def resolve_max_model_len(self, model: ModelConfig, capacity: KvCapacity) -> int:
        """The context `max_model_len` means for `model` and the pool `capacity`: the model's
        when unset, auto clamped to the pool; refused beyond the model's positions or its sliding
        window. Torch-free: `kvseal plan` resolves it with this too."""
        max_model_len = self._max_model_len_for(model, capacity)
        if model.sliding_window is not None and max_model_len > model.sliding_window:
            raise ConfigError(
                f"the model uses sliding-window attention (window {model.sliding_window}) and kvseal "
                f"attends over the full context; set max_model_len <= {model.sliding_window}"
            )
        return max_model_len

    def _max_model_len_for(self, model: ModelConfig, capacity: KvCapacity) -> int:
        limit = model.max_position_embeddings
        if self.max_model_len is None:
            return limit
        if self.max_model_len == "auto":
            fitted = min(limit, int(capacity.pool_tokens / self.kv_headroom))
            if fitted < 1:
                raise ConfigError(f"max_model_len=auto: a pool of {capacity.pool_tokens} tokens at kv_headroom "
                                  f"{self.kv_headroom} fits no context; give the KV cache more memory or tokens")
            logger.warning("max_model_len=auto: context clamped to %d tokens (model allows %d, pool holds %d)",
                           fitted, limit, capacity.pool_tokens)
            return fitted
        if self.max_model_len > limit:
            raise ConfigError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}; "
                f"set max_model_len <= {limit}"
            )
        return int(self.max_model_len)


def is_wildcard(addr: str) -> bool:
    """Whether `addr` is the any-address in one of the spellings the socket calls take: "0.0.0.0",
    "::", "*", and "0", "0x0", "000.000.000.000", "::0"... (read as numbers, no name lookup)."""
    if addr == "*":
        return True
    try:
        infos = socket.getaddrinfo(addr, None, flags=socket.AI_NUMERICHOST)
    except (socket.gaierror, UnicodeError, ValueError):
        return False  # a host name: rank 0's listener refuses it if it names the any-address
    return any(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_unspecified for info in infos)
